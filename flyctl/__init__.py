"""``flyctl``: the operator's CLI over Redis (status, queue, bind/release by hand, drain)."""
