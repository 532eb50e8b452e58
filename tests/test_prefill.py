"""Multi-block prefill's chunk choice: a prompt that would leave a chunk bucket mostly padding goes in two calls
(the largest bucket it fills, then the rest), with the same outputs as one-bucket chunks."""

from conftest import ENGINE_KW

GREEDY = {"max_new_tokens": 6, "ignore_eos": True}


def test_half_padded_chunk_is_split(tiny_model, make_engine):
    # B = 4, chunk buckets 4 and 8 blocks (the budget): 5 blocks would fill only 5/8 of the 8-block chunk
    engine = make_engine(tiny_model, max_prefill_tokens=32,
                         **dict(ENGINE_KW, shape_buckets=dict(ENGINE_KW["shape_buckets"], prefill_blocks=(4, 8))))
    assert [engine.runner.prefill_chunk(n) for n in (1, 3, 4, 5, 6, 7, 8, 20)] == [4, 4, 4, 4, 8, 8, 8, 8]
    prompts = [list(range(2, 24)), list(range(31, 60))]  # 5 and 7 complete blocks (+ a partial one)
    outs = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
    # 7 blocks: one 8-block call (one padded block); 5 blocks: 4 + 1 (two calls, not one 8-block call)
    assert engine.scheduler.stats["prefill_forwards"] == 3
    plain = make_engine(tiny_model, **ENGINE_KW)  # chunks of 4 blocks only
    assert [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=GREEDY)] == outs
