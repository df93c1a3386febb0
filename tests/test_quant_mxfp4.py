"""gpt-oss with MXFP4 experts, as its releases publish them: a tiny float32 gpt-oss made by
`transformers`, its experts written in the releases' layout by our writer
(`pdserve.engine.quant.mxfp4_checkpoint`), served with the experts kept as FP4 blocks and E8M0
scales.

The tokens' references: transformers running the same MXFP4 checkpoint (5.x dequantizes it into
the model's dtype on load where no GPU kernels are installed; it asks for `accelerate`, and the
test skips saying so without it), and pdserve on the same weights dequantized into a float32
checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from checkpoints import build_checkpoint, dequantize_checkpoint_mxfp4, hf_greedy
from conftest import random_prompts
from safetensors.torch import load_file, save_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.models.config import ModelConfig
from pdserve.engine.models.loader import build_model, load_model
from pdserve.engine.quant.mxfp4_checkpoint import RELEASE_NOT_CONVERTED, write_mxfp4_checkpoint
from pdserve.engine.quant.mxfp4_experts import Mxfp4Experts
from pdserve.engine.quant.mxfp4_reference import dequantize, quantize
from pdserve.engine.quant.mxfp4_scheme import Mxfp4Scheme
from pdserve.engine.tp.model_shard import weight_line
from pdserve.engine.tp.shard import TPShard
from pdserve.tune.local_server import PdserveServer, PdserveSystem

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPT_LENGTHS = [3, 9, 17, 30]
FAMILY = "gpt_oss_mxfp4"  # hidden 64, 4 experts of width 96, 2 layers


@pytest.fixture(scope="module")
def mxfp4_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the MXFP4 checkpoint, its experts dequantized into a float32 copy), built once."""
    root = tmp_path_factory.mktemp("mxfp4")
    plain = build_checkpoint(FAMILY, root / "float32")
    mxfp4 = write_mxfp4_checkpoint(plain, root / "mxfp4")
    return mxfp4, dequantize_checkpoint_mxfp4(mxfp4, root / "dequantized")


def greedy(model_dir: Path, prompts: list[list[int]], **engine: object) -> list[list[int]]:
    with LLM(str(model_dir), num_kv_blocks=64, device="cpu", **engine) as llm:
        return [o.token_ids for o in llm.generate(prompts, GREEDY)]


# --- the layout and its reference ----------------------------------------------------------------


def test_reference_reads_low_nibble_first_sign_bit_and_e8m0_scales():
    # Two rows of one block of 32 (16 bytes); the first bytes set by hand, the rest zero.
    blocks = torch.zeros(2, 1, 16, dtype=torch.uint8)
    # 0x21: low nibble 1 (+0.5) then high 2 (+1.0); 0xF8: -0.0 then 0xF (-6);
    # 0x7A: 0xA (-1.0) then 7 (+6); 0x53: 3 (+1.5) then 5 (+3); 0xC4: 4 (+2) then 0xC (-2).
    blocks[0, 0, :4] = torch.tensor([0x21, 0xF8, 0x7A, 0x53], dtype=torch.uint8)
    blocks[1, 0, :2] = torch.tensor([0xC4, 0x9E], dtype=torch.uint8)  # 0x9E: -4 then -0.5
    scales = torch.tensor([[127], [125]], dtype=torch.uint8)  # 2 ** 0 and 2 ** -2
    out = dequantize(blocks, scales)
    assert out.shape == (2, 32) and out.dtype == torch.float32
    assert out[0, :8].tolist() == [0.5, 1.0, -0.0, -6.0, -1.0, 6.0, 1.5, 3.0]
    assert out[1, :4].tolist() == [0.5, -0.5, -1.0, -0.125]
    assert not out[0, 8:].any() and not out[1, 4:].any()
    big = dequantize(blocks[:1], torch.tensor([[130]], dtype=torch.uint8))  # 2 ** 3
    assert big[0, :4].tolist() == [4.0, 8.0, -0.0, -48.0]


def test_reference_reads_every_block_by_its_own_scale_along_the_input():
    # One row of 64 inputs, two blocks: every byte 0x22 (1.0, 1.0), scales 2 ** 1 and 2 ** -1.
    blocks = torch.full((1, 2, 16), 0x22, dtype=torch.uint8)
    out = dequantize(blocks, torch.tensor([[128, 126]], dtype=torch.uint8))
    assert out[0, :32].unique().tolist() == [2.0] and out[0, 32:].unique().tolist() == [0.5]
    with pytest.raises(ValueError, match="expected"):
        dequantize(blocks, torch.tensor([[128]], dtype=torch.uint8))


def test_bfloat16_dequantization_is_exactly_the_float32_one():
    # Every byte, with scales from 2 ** -127 (bfloat16's subnormals too) to 2 ** 125.
    blocks = torch.arange(256, dtype=torch.uint8).repeat(253).view(253, 16, 16)
    scales = torch.arange(253, dtype=torch.uint8)[:, None].expand(253, 16).contiguous()
    wide = dequantize(blocks, scales)
    narrow = dequantize(blocks, scales, torch.bfloat16)
    assert narrow.dtype == torch.bfloat16 and wide.isfinite().all()
    assert torch.equal(narrow.float(), wide)  # no value rounds
    assert torch.equal(dequantize(blocks, scales, torch.float16), wide.half())


def test_the_layout_is_the_one_transformers_dequantizes():
    """transformers' own reader of the releases (`convert_moe_packed_tensors`) gives the
    reference's weights, transposed into its [experts, in, out] layout, on random bytes."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 6, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(118, 136, (3, 6, 4), dtype=torch.uint8, generator=gen)
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(theirs, dequantize(blocks, scales).transpose(1, 2))


def test_writer_rounds_scales_up_to_a_power_of_two_and_values_to_the_nearest():
    weight = torch.zeros(3, 64)
    weight[0, :8] = torch.tensor([6.0, 0.25, 0.75, 1.25, 2.5, 5.0, -3.0, -0.4])  # amax 6: 2**0
    weight[1, 0] = 6.5  # amax past 6: the scale doubles, 6.5 / 2 rounds to 3
    weight[2, 32] = 3.0  # amax 3 = 6 * 2 ** -1 exactly: scale 2 ** -1
    blocks, scales = quantize(weight)
    assert blocks.shape == (3, 2, 16) and scales.shape == (3, 2)
    assert scales.tolist() == [[127, 0], [128, 0], [0, 126]]  # an all-zero block: 2 ** -127
    out = dequantize(blocks, scales)
    # Ties go to the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 2.5 -> 2, 5 -> 4.
    assert out[0, :8].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 4.0, -3.0, -0.5]
    assert out[1, 0] == 6.0 and out[2, 32] == 3.0
    assert blocks[0, 0, 0] == 0x07  # 6.0 (code 7) in the low nibble, 0.0 in the high
    big = torch.randn(8, 128)
    blocks, scales = quantize(big)
    # FP4's spacing is at most a third of a value's magnitude, plus a scale's worth near zero.
    error = (dequantize(blocks, scales) - big).abs()
    assert (error <= big.abs() / 3 + 2.0 ** (scales.float() - 127).repeat_interleave(32, 1)).all()


def test_the_written_checkpoint_holds_the_release_names_dtypes_and_shapes(mxfp4_dirs):
    from safetensors import safe_open

    mxfp4, _ = mxfp4_dirs
    qcfg = json.loads((mxfp4 / "config.json").read_text())["quantization_config"]
    assert qcfg == {"quant_method": "mxfp4", "modules_to_not_convert": list(RELEASE_NOT_CONVERTED)}
    with safe_open(str(mxfp4 / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        p = "model.layers.1.mlp.experts."
        shapes = {n: (f.get_tensor(p + n).dtype, tuple(f.get_tensor(p + n).shape)) for n in (
            "gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales",
            "gate_up_proj_bias", "down_proj_bias",
        )}  # fmt: skip
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.float32
    # 4 experts, hidden 64, width 96: gate_up [4, 192 out, 64 in], down [4, 64 out, 96 in].
    assert shapes == {
        "gate_up_proj_blocks": (torch.uint8, (4, 192, 2, 16)),
        "gate_up_proj_scales": (torch.uint8, (4, 192, 2)),
        "down_proj_blocks": (torch.uint8, (4, 64, 3, 16)),
        "down_proj_scales": (torch.uint8, (4, 64, 3)),
        "gate_up_proj_bias": (torch.float32, (4, 192)),
        "down_proj_bias": (torch.float32, (4, 64)),
    }
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)


def test_the_written_experts_dequantize_to_the_float_experts_they_were_made_from(mxfp4_dirs):
    mxfp4, _ = mxfp4_dirs
    source = load_file(str(mxfp4.parent / "float32" / "model.safetensors"))
    written = load_file(str(mxfp4 / "model.safetensors"))
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        float_weight = source[name]  # transformers' [experts, in, out]
        back = dequantize(written[name + "_blocks"], written[name + "_scales"]).transpose(1, 2)
        assert back.shape == float_weight.shape
        # Within FP4's rounding: a third of each value, plus half the block's smallest step.
        step = float_weight.abs().amax() / 6 / 2
        assert ((back - float_weight).abs() <= float_weight.abs() / 3 + step).all()
        assert torch.corrcoef(torch.stack([back.flatten(), float_weight.flatten()]))[0, 1] > 0.97


# --- tokens --------------------------------------------------------------------------------------


def test_mxfp4_greedy_tokens_equal_transformers_on_the_same_checkpoint(mxfp4_dirs):
    pytest.importorskip(
        "accelerate", reason="transformers loads MXFP4 checkpoints only with accelerate installed"
    )
    import transformers

    mxfp4, _ = mxfp4_dirs
    # transformers dequantizes the experts into float32 exactly as the reference does.
    hf = transformers.AutoModelForCausalLM.from_pretrained(mxfp4, dtype=torch.float32)
    stored = load_file(str(mxfp4 / "model.safetensors"))
    p = "model.layers.0.mlp.experts.down_proj"
    expected = dequantize(stored[p + "_blocks"], stored[p + "_scales"]).transpose(1, 2)
    assert torch.equal(hf.model.layers[0].mlp.experts.down_proj.data, expected)
    prompts = random_prompts(5, PROMPT_LENGTHS)
    assert greedy(mxfp4, prompts) == hf_greedy(mxfp4, prompts, GREEDY.max_tokens)


def test_mxfp4_greedy_tokens_equal_the_dequantized_float_checkpoint(mxfp4_dirs):
    mxfp4, dequantized = mxfp4_dirs
    prompts = random_prompts(6, PROMPT_LENGTHS)
    assert greedy(mxfp4, prompts) == greedy(dequantized, prompts)


def test_tensor_parallel_mxfp4_gives_the_tokens_of_one_rank(mxfp4_dirs):
    """Each rank's 48 of the experts' 96 columns are 1.5 blocks: the first rank's end inside
    block 1, the second's start there (as gpt-oss-120b's 2880 split in 4 are 22.5 blocks)."""
    mxfp4, _ = mxfp4_dirs
    cfg = ModelConfig.from_pretrained(mxfp4)
    TPShard(0, 2).check(cfg)  # no split of the experts is refused
    second = build_model(cfg, "float32", "cpu", TPShard(1, 2)).layers[0].mlp.experts
    assert (second.down_groups, second.down_skip) == (range(1, 3), 16)
    prompts = random_prompts(7, PROMPT_LENGTHS)
    assert greedy(mxfp4, prompts, tensor_parallel_size=2) == greedy(mxfp4, prompts)


# --- memory --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_experts_stay_fp4_blocks_and_e8m0_scales_a_quarter_of_bf16(mxfp4_dirs, dtype):
    mxfp4, dequantized = mxfp4_dirs
    model = load_model(mxfp4, dtype, "cpu")
    experts = [m for m in model.modules() if isinstance(m, Mxfp4Experts)]
    assert len(experts) == 2
    assert all(p.dtype == torch.uint8 for m in experts for p in m.parameters())
    # Per layer: 4 experts of gate_up 192x64 and down 64x96 weights, half a byte each, and a
    # byte of scale per 32 of them.
    weights = 2 * 4 * (192 * 64 + 64 * 96)
    assert sum(p.nbytes for m in experts for p in m.parameters()) == weights // 2 + weights // 32
    assert (weights // 2 + weights // 32) / (2 * weights) == pytest.approx(0.2656, abs=1e-4)
    # The whole model against the float copy of the same weights in the same dtype.
    plain = load_model(dequantized, dtype, "cpu")
    size = torch.finfo(getattr(torch, dtype)).bits // 8
    saved = sum(p.nbytes for p in plain.parameters()) - sum(p.nbytes for p in model.parameters())
    assert saved == weights * size - (weights // 2 + weights // 32)
    assert "in 2 layers' experts kept in mxfp4 (e2m1 in blocks of 32, e8m0 scales)" in (
        weight_line(model)
    )
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == getattr(torch, dtype)


# --- refusals ------------------------------------------------------------------------------------


def gpt_oss_config(**fields: object) -> dict:
    release = {"quant_method": "mxfp4", "modules_to_not_convert": list(RELEASE_NOT_CONVERTED)}
    return {
        "model_type": "gpt_oss",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 4,
        "quantization_config": {**release, **fields},
    }


def test_the_release_config_quantizes_the_experts_only():
    scheme = ModelConfig.from_dict(gpt_oss_config()).quantization
    assert isinstance(scheme, Mxfp4Scheme)
    assert scheme.quantizes("model.layers.11.mlp.experts")
    for kept in ("model.layers.3.self_attn", "model.layers.3.mlp.router", "lm_head"):
        assert not scheme.quantizes(kept)
    # transformers' matching: a pattern stops at a module boundary ("layers.1" is not 11's).
    one = Mxfp4Scheme(not_converted=("model.layers.1",))
    assert not one.quantizes("model.layers.1.mlp.experts")
    assert one.quantizes("model.layers.11.mlp.experts")


@pytest.mark.parametrize(
    "field,value",
    [
        ("quant_method", "mxfp8"),
        ("modules_to_not_convert", "lm_head"),
        ("dequantize", "yes"),
    ],
)
def test_each_unsupported_field_value_is_refused_by_name(field, value):
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict(gpt_oss_config(**{field: value}))
    message = str(err.value)
    assert "\n" not in message
    assert f"config.json field 'quantization_config.{field}' = {value!r} is not supported" in (
        message
    )


def test_mxfp4_is_refused_for_another_family_and_fp8_for_gpt_oss():
    llama = {**gpt_oss_config(), "model_type": "llama"}
    with pytest.raises(ValueError, match="'mxfp4' is not supported for model_type 'llama'"):
        ModelConfig.from_dict(llama)
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict({**gpt_oss_config(), "quantization_config": fp8})
    assert str(err.value) == (
        "config.json field 'quantization_config.quant_method' = 'fp8' is not supported "
        "(supported: 'mxfp4' for model_type 'gpt_oss')"
    )


@pytest.mark.parametrize("field", ["intermediate_size", "hidden_size"])
def test_experts_whose_inputs_are_not_whole_blocks_are_refused_naming_the_field(field):
    cfg = ModelConfig.from_dict({**gpt_oss_config(), field: 48})
    with pytest.raises(ValueError, match=f"'{field}' = 48 is not a multiple of 32"):
        build_model(cfg, "float32", "cpu")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("float", "'model.layers.1.mlp.experts.down_proj_blocks' is stored as F32"),
        ("reshape", "'model.layers.1.mlp.experts.gate_up_proj_scales' has shape (4, 64, 2)"),
        ("drop", "missing weight 'model.layers.1.mlp.experts.down_proj_scales'"),
    ],
)
def test_a_misstored_or_missing_expert_tensor_is_refused_naming_it(
    mxfp4_dirs, tmp_path, change, message
):
    import shutil

    mxfp4, _ = mxfp4_dirs
    shutil.copytree(mxfp4, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(path)
    p = "model.layers.1.mlp.experts."
    if change == "float":
        tensors[p + "down_proj_blocks"] = tensors[p + "down_proj_blocks"].float()
    elif change == "reshape":
        tensors[p + "gate_up_proj_scales"] = tensors[p + "gate_up_proj_scales"][:, :64].clone()
    else:
        del tensors[p + "down_proj_scales"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message.replace("(", "\\(").replace(")", "\\)")):
        LLM(str(tmp_path / "ckpt"), num_kv_blocks=16, device="cpu")


# --- served --------------------------------------------------------------------------------------


@pytest.mark.cluster
def test_pdserve_serve_disaggregated_gives_the_offline_mxfp4_tokens(mxfp4_dirs, tmp_path):
    mxfp4, _ = mxfp4_dirs
    prompt = random_prompts(8, [14])[0]
    with LLM(str(mxfp4), num_kv_blocks=64, device="cpu") as llm:
        (out,) = llm.generate([prompt], GREEDY)
        expected = llm.tokenizer.decode(out.token_ids)
    system = PdserveSystem("mxfp4", prefill_nodes=1, decode_nodes=1, flags=("--insecure",))
    with PdserveServer(system, tmp_path, str(mxfp4)) as server:
        body = {
            "model": httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"],
            "prompt": prompt,
            "max_tokens": GREEDY.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        reply = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()
        logs = "".join(p.read_text() for p in (tmp_path / "mxfp4").rglob("*.log"))
    assert reply["choices"][0]["text"] == expected
    assert reply["usage"]["completion_tokens"] == GREEDY.max_tokens
    assert "layers' experts kept in mxfp4" in logs
