import pytest

from loadgen.trace import PRESETS, TraceColumns, parse_columns, read_mooncake, read_trace


def write(tmp_path, text, name="t.csv"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_native_trace_sorted_relative_with_priorities(tmp_path):
    p = write(
        tmp_path, "timestamp,input_tokens,output_tokens,priority\n12.5,100,20,high\n10,50,10,\n11,70,5,low\n"
    )
    rows = read_trace(p)
    assert [r.at for r in rows] == [0, 1, 2.5]
    assert [(r.input_tokens, r.output_tokens, r.priority) for r in rows] == [
        (50, 10, None),
        (70, 5, "low"),
        (100, 20, "high"),
    ]


def test_azure_iso_timestamps_with_seven_fraction_digits(tmp_path):
    p = write(
        tmp_path,
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n",
    )
    rows = read_trace(p, parse_columns("azure"))
    assert rows[1].at == pytest.approx(4.314579, abs=1e-6)
    assert (rows[0].input_tokens, rows[0].output_tokens) == (374, 44)


def test_burstgpt_columns_speed_and_limit(tmp_path):
    p = write(
        tmp_path,
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n9,GPT-4,1087,0,1087,Conversation log\n13,GPT-4,10,3,13,API log\n",
    )
    rows = read_trace(p, PRESETS["burstgpt"], speed=2.0, limit=2)
    assert [r.at for r in rows] == [0, 2]
    assert rows[1].output_tokens == 1  # a zero-length response still asks for one token


def test_explicit_mapping_and_milliseconds(tmp_path):
    p = write(tmp_path, "ts,in,out\n1000,5,6\n1500,7,8\n")
    cols = parse_columns("timestamp=ts,input_tokens=in,output_tokens=out")
    assert cols == TraceColumns("ts", "in", "out", "priority")
    assert [r.at for r in read_trace(p, cols, time_unit="ms")] == [0, 0.5]


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="missing column"):
        read_trace(write(tmp_path, "a,b\n1,2\n"))
    with pytest.raises(ValueError, match=r"t.csv:3"):
        read_trace(write(tmp_path, "timestamp,input_tokens,output_tokens\n1,2,3\nx,2,3\n"))
    with pytest.raises(ValueError, match="bad trace column"):
        parse_columns("when=ts")


def test_an_unknown_priority_or_a_negative_token_count_names_the_row(tmp_path):
    head = "timestamp,input_tokens,output_tokens,priority\n"
    with pytest.raises(
        ValueError, match=r"t.csv:3: unknown priority 'urgent' \(the classes are high, normal, low\)"
    ):
        read_trace(write(tmp_path, head + "0,5,5,high\n1,5,5,urgent\n"))
    with pytest.raises(ValueError, match="t.csv:2: output_tokens is -5: a token count cannot be negative"):
        read_trace(write(tmp_path, head + "0,5,-5,\n"))
    with pytest.raises(ValueError, match="t.csv:2: "):
        read_trace(write(tmp_path, head + "0,inf,5,\n"))


def test_a_mooncake_trace_is_read_in_seconds_sorted_relative_with_its_hash_ids(tmp_path):
    p = write(
        tmp_path,
        '{"timestamp": 2500, "input_length": 600, "output_length": 3, "hash_ids": [0, 2]}\n\n'
        '{"timestamp": 1500, "input_length": 700, "output_length": 0, "hash_ids": [0, 1]}\n',
        "m.jsonl",
    )
    rows = read_mooncake(p, speed=2.0)
    assert [(r.at, r.input_tokens, r.output_tokens, r.hash_ids) for r in rows] == [
        (0.0, 700, 1, (0, 1)),
        (0.5, 600, 3, (0, 2)),
    ]


def test_a_bad_mooncake_line_is_named(tmp_path):
    p = write(
        tmp_path, '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1}\n', "m.jsonl"
    )
    with pytest.raises(ValueError, match=r"m.jsonl:2: missing 'input_length'"):
        read_mooncake(p)
