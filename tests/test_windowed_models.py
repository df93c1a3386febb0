"""A windowed KV group's blocks stay bounded while a sequence grows, served from transformers' own
tiny Qwen2 checkpoint with one full and two windowed layers. Greedy parity of the windowed
families with transformers (Qwen2 and Mistral windowed, gpt-oss, Gemma 3, Llama 4) is in
test_windowed_family_parity.py."""

from __future__ import annotations

from windowed_families import WINDOWED_FAMILIES

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kv.kv_manager import FREED


def test_a_windowed_groups_blocks_stay_bounded_while_a_sequence_grows(checkpoint_dir):
    model_dir = checkpoint_dir("qwen2_sliding")
    prompt = WINDOWED_FAMILIES["qwen2_sliding"].prompts()[-1]  # 150 tokens
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=600, device="cpu")
    engine = llm.engine
    engine.add_request("long", prompt, SamplingParams(max_tokens=60, ignore_eos=True))
    held = []
    while engine.has_unfinished():
        engine.step()
        seq = engine.seqs.get("long")
        if seq is not None and seq.num_computed_tokens:
            full, *windowed = seq.block_tables
            assert FREED not in full
            held.append(max(sum(b != FREED for b in table) for table in windowed))
    # The window's 12 tokens span at most 4 blocks of 4, plus the one being written.
    assert max(held[1:]) <= 5
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
