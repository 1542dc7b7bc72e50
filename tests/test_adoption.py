"""worker_ext.adoption: what a follower does with the KV a scatter sends it back."""

from __future__ import annotations

import torch

from tests.fakes import FakeEngine, FakeLayout, FakeReq
from worker_ext.adoption import Adoption
from worker_ext.kv_transform import Held
from worker_ext.ownership import Ownership
from worker_ext.step_plan import Shadows


def test_a_follower_frees_the_kv_scattered_back_for_a_request_its_client_already_aborted():
    """The follower ended its own request at the client's abort while the leader still ran its copy: the scatter
    at the release sends that request's KV back to it all the same. Nothing takes it, so it is freed (a leak that
    SGLang's idle check turns into a crash otherwise); the request it still owns gets its KV."""
    engine, layout = FakeEngine(), FakeLayout()
    layout.bind(2, 1, None)
    ownership = Ownership(engine)
    kept = FakeReq("kept")
    ownership.add_owned([kept])
    ownership.add_owned([FakeReq("gone")])
    ownership.end_aborted(["gone"])
    adoption = Adoption(engine, 1, layout, ownership, Shadows(engine))
    held = [Held("kept", 1, 3), Held("gone", 1, 2)]
    taken = {"kept": torch.tensor([10, 11, 12]), "gone": torch.tensor([20, 21])}
    back = adoption._follower_scatters(held, {"kept", "gone"}, taken)
    assert back == [kept]
    assert layout.sub_allocator().freed == [20, 21]
