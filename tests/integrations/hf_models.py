"""Tiny transformers models built from configs, and checkpoints written from the format facts.

Checkpoint layouts (FORMATS.md, quantdispatch/checkpoints/reader.py): ModelOpt NVFP4 stores
``weight`` (packed uint8), ``weight_scale`` (e4m3), ``weight_scale_2`` (the per-tensor
multiplier); compressed-tensors stores ``weight_packed``, ``weight_scale`` and
``weight_global_scale`` (its reciprocal); gpt-oss stores experts as ``*_blocks`` [E, N, K/32, 16]
and ``*_scales`` (e8m0); FP8 stores ``weight`` (e4m3) and ``weight_scale``. MoE experts are stored
one linear per expert (``experts.{e}.gate_proj`` ..., Mixtral ``block_sparse_moe.experts.{e}.w1``).

The reference weights are decoded here from the bytes with the format definitions (e2m1 table,
e4m3 via torch's float8 dtype, e8m0 = 2^(b-127)), independently of quantdispatch's dequantizers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from quantdispatch.formats import quantize_mxfp4, quantize_nvfp4

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=256,
    initializer_range=0.08,
    bos_token_id=None,
    eos_token_id=None,  # generation runs the full length
    pad_token_id=None,
)

PROMPT = torch.tensor([[3, 17, 42, 99, 7, 128]])


def make_config(arch: str, **overrides):
    import transformers as tf

    kw = dict(TINY)
    if arch == "llama":
        kw.update(intermediate_size=128, tie_word_embeddings=True)
        cls = tf.LlamaConfig
    elif arch == "qwen3":  # q / k norms after the projections; otherwise Llama's layer
        kw.update(intermediate_size=128, tie_word_embeddings=False)
        cls = tf.Qwen3Config
    elif arch == "qwen3_moe":
        kw.update(intermediate_size=128, moe_intermediate_size=64, num_experts=4)
        kw.update(num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False)
        cls = tf.Qwen3MoeConfig
    elif arch == "qwen2_moe":
        kw.update(intermediate_size=128, moe_intermediate_size=64, num_experts=4)
        kw.update(num_experts_per_tok=2, shared_expert_intermediate_size=64)
        cls = tf.Qwen2MoeConfig
    elif arch == "mixtral":
        kw.update(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
        cls = tf.MixtralConfig
    elif arch == "olmoe":
        kw.update(intermediate_size=64, num_experts=4, num_experts_per_tok=2)
        cls = tf.OlmoeConfig
    elif arch == "deepseek_v3":
        kw.update(intermediate_size=128, moe_intermediate_size=64, n_routed_experts=4)
        kw.update(num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1)
        kw.update(first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32)
        kw.update(qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
        kw.update(num_key_value_heads=4)  # MLA: one key/value head per query head
        kw.pop("head_dim")
        cls = tf.DeepseekV3Config
    elif arch == "phi3":  # fused qkv_proj / gate_up_proj in the model
        kw.update(intermediate_size=128, tie_word_embeddings=False)
        kw.pop("head_dim")
        cls = tf.Phi3Config
    elif arch == "gpt_oss":
        kw.update(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
        kw.update(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
        cls = tf.GptOssConfig
    else:
        raise ValueError(arch)
    kw.update(overrides)
    return cls(**kw)


def float_model(config, seed: int = 0, dtype=torch.float32):
    """A randomly initialised model (fixed seed); gpt-oss gets non-zero expert biases."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    for name, p in model.named_parameters():
        if name.endswith(("gate_up_proj_bias", "down_proj_bias")):
            with torch.no_grad():
                p.normal_(0.0, 0.05)
    return model.eval()


def greedy(model, n: int = 16, prompt: torch.Tensor = PROMPT, **kw) -> list[int]:
    with torch.no_grad():
        out = model.generate(prompt.to(model.device), max_new_tokens=n, do_sample=False, **kw)
    return out[0, prompt.shape[1] :].tolist()


# -- decoding the bytes (format facts) ----------------------------------------------------------

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def fp4_values(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2], low nibble = even column -> float64 [N, K]."""
    lo, hi = packed & 0xF, packed >> 4
    codes = torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1).long()
    mag = _E2M1[codes & 7]
    return torch.where(codes >= 8, -mag, mag)


def nvfp4_decode(packed, block_scale, multiplier) -> torch.Tensor:
    s = block_scale.to(torch.float64).repeat_interleave(16, dim=1)
    return fp4_values(packed) * s * float(multiplier)


def mxfp4_decode(packed, scale_u8) -> torch.Tensor:
    s = torch.pow(2.0, scale_u8.to(torch.float64) - 127).repeat_interleave(32, dim=1)
    return fp4_values(packed) * s


def fp8_decode(weight, scale) -> torch.Tensor:
    return weight.to(torch.float64) * scale.to(torch.float64)


# -- writing checkpoints ------------------------------------------------------------------------


def _pow2_at_least(x: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, torch.ceil(torch.log2(x.double().clamp(min=2.0**-100)))).float()


def _quantized_tensors(w: torch.Tensor, fmt: str, producer: str, w4a4: bool):
    """({leaf: tensor}, decoded float64 weight) of one [N, K] weight.

    Per-tensor / per-channel scales are powers of two, so the decoded weights are exact in bf16
    and the reference model holds exactly the weights the quantized layers compute with."""
    if fmt == "nvfp4":
        gs = _pow2_at_least(w.abs().amax() / (6 * 448))
        q = quantize_nvfp4(w, global_scale=gs, with_input_scale=0.05 if w4a4 else None)
        ref = nvfp4_decode(q.packed, q.block_scale, q.global_scale)
        if producer == "ct":
            t = {
                "weight_packed": q.packed,
                "weight_scale": q.block_scale,
                "weight_global_scale": (1.0 / q.global_scale.double()).float().reshape(1),
            }
            if w4a4:
                t["input_global_scale"] = torch.tensor([20.0])
            return t, ref
        t = {"weight": q.packed, "weight_scale": q.block_scale, "weight_scale_2": q.global_scale}
        if w4a4:
            t["input_scale"] = torch.tensor(0.05)
        return t, ref
    if fmt == "mxfp4":
        q = quantize_mxfp4(w)
        return {"weight_packed": q.packed, "weight_scale": q.block_scale}, mxfp4_decode(
            q.packed, q.block_scale
        )
    if producer == "ct":  # per-channel scales [N, 1]
        scale = _pow2_at_least(w.abs().amax(dim=1, keepdim=True) / 448)
    else:  # ModelOpt: one per-tensor scale
        scale = _pow2_at_least(w.abs().amax() / 448)
    codes = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    t = {"weight": codes, "weight_scale": scale}
    if w4a4:
        t["input_scale"] = torch.tensor(0.02)
    return t, fp8_decode(codes, scale)


def _experts_layout(arch: str) -> tuple[str, tuple[str, str, str]]:
    if arch == "mixtral":
        return ".block_sparse_moe", ("w1", "w3", "w2")
    return ".mlp", ("gate_proj", "up_proj", "down_proj")


def write_checkpoint(
    model,
    path: Path,
    *,
    arch: str,
    fmt: str = "nvfp4",
    producer: str = "modelopt",
    w4a4: bool = False,
    exclude: tuple[str, ...] = ("lm_head",),
    where: str = "hf_quant_config",
    split: dict[str, torch.Tensor] | None = None,
    float_experts: bool = False,
) -> dict[str, torch.Tensor]:
    """Write ``model`` quantized as a checkpoint folder; return the reference state dict (the
    decoded weights, in the model's own names, float32). ``split``: {shard module: weight} to
    store instead of the fused module that is their parent's (q/k/v of a qkv_proj)."""
    path.mkdir(parents=True, exist_ok=True)
    sd = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    fused: dict[str, list[torch.Tensor]] = {}
    for shard, w in (split or {}).items():
        parent = shard.rpartition(".")[0]
        leaf = "qkv_proj" if shard.endswith(("q_proj", "k_proj", "v_proj")) else "gate_up_proj"
        tensors, decoded = _quantized_tensors(w.contiguous(), fmt, producer, w4a4)
        out.update({f"{shard}.{name}": t for name, t in tensors.items()})
        fused.setdefault(f"{parent}.{leaf}.weight", []).append(decoded)
    ref.update({k: torch.cat(v).float() for k, v in fused.items()})
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if arch == "gpt_oss":
        linears = set()  # gpt-oss quantizes its experts only
    for key, value in sd.items():
        module, _, leaf = key.rpartition(".")
        if key in fused:
            continue
        if module in linears and leaf == "weight" and module not in exclude:
            tensors, decoded = _quantized_tensors(value, fmt, producer, w4a4)
            for name, t in tensors.items():
                out[f"{module}.{name}"] = t
            ref[key] = decoded.float()
        elif module.endswith(".experts") and leaf in ("gate_up_proj", "down_proj"):
            _write_experts(out, ref, key, sd, arch, fmt, producer, w4a4, float_experts)
        elif module.endswith(".experts") and leaf.endswith("_bias") and arch == "gpt_oss":
            out[key] = value.to(torch.bfloat16)
            ref[key] = out[key].float()
        else:
            if key == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False):
                continue
            name = key.replace(".mlp.", ".block_sparse_moe.") if arch == "mixtral" else key
            out[name] = value.to(torch.bfloat16).contiguous()
            ref[key] = out[name].float()
    save_file(out, str(path / "model.safetensors"))
    model.config.save_pretrained(str(path))
    _write_quant_config(path, fmt, producer, w4a4, exclude, where, arch)
    return ref


def _write_experts(out, ref, key, sd, arch, fmt, producer, w4a4, float_experts=False) -> None:
    block = key.rpartition(".experts.")[0]
    leaf = key.rpartition(".")[2]
    w = sd[key]
    e = w.shape[0]
    if arch == "gpt_oss":
        # [E, H, 2I] (x @ W, interleaved gate/up columns) -> blocks [E, 2I, H/32, 16]
        packed, scales, decoded = [], [], []
        for i in range(e):
            q = quantize_mxfp4(w[i].T.contiguous())
            packed.append(q.packed.reshape(q.packed.shape[0], -1, 16))
            scales.append(q.block_scale)
            decoded.append(mxfp4_decode(q.packed, q.block_scale).T)
        out[f"{block}.experts.{leaf}_blocks"] = torch.stack(packed)
        out[f"{block}.experts.{leaf}_scales"] = torch.stack(scales)
        ref[key] = torch.stack(decoded).float()
        return
    prefix, (gate_n, up_n, down_n) = _experts_layout(arch)
    ck_block = block.replace(".mlp", prefix)
    decoded = []
    for i in range(e):
        if leaf == "gate_up_proj":
            inter = w.shape[1] // 2
            parts = ((gate_n, w[i, :inter]), (up_n, w[i, inter:]))
        else:
            parts = ((down_n, w[i]),)
        rows = []
        for name, part in parts:
            if float_experts:
                value = part.to(torch.bfloat16).contiguous()
                out[f"{ck_block}.experts.{i}.{name}.weight"] = value
                rows.append(value.double())
                continue
            tensors, dec = _quantized_tensors(part.contiguous(), fmt, producer, w4a4)
            for t_name, t in tensors.items():
                out[f"{ck_block}.experts.{i}.{name}.{t_name}"] = t
            rows.append(dec)
        decoded.append(torch.cat(rows))
    ref[key] = torch.stack(decoded).float()


def _write_quant_config(path, fmt, producer, w4a4, exclude, where, arch) -> None:
    if arch == "gpt_oss":
        qc = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
        qc["modules_to_not_convert"] += ["model.layers.*.mlp.router", "lm_head"]
        _into_config(path, qc)
        return
    if producer == "ct":
        weights = {"num_bits": 4 if fmt != "fp8" else 8, "type": "float", "symmetric": True}
        weights["group_size"] = {"nvfp4": 16, "mxfp4": 32}.get(fmt)
        group = {"targets": ["Linear"], "weights": weights}
        if w4a4:
            group["input_activations"] = {"num_bits": weights["num_bits"], "type": "float"}
        ct_fmt = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}
        qc = {
            "quant_method": "compressed-tensors",
            "format": ct_fmt.get(fmt, "float-quantized"),
            "config_groups": {"group_0": group},
            "ignore": list(exclude),
        }
        _into_config(path, qc)
        return
    algo = {"nvfp4": "NVFP4" if w4a4 else "W4A16_NVFP4", "fp8": "FP8"}[fmt]
    section = {"quant_algo": algo, "exclude_modules": list(exclude)}
    if fmt == "nvfp4":
        section["group_size"] = 16
    if where == "hf_quant_config":
        body = {"producer": {"name": "modelopt"}, "quantization": section}
        (path / "hf_quant_config.json").write_text(json.dumps(body), encoding="utf-8")
    else:
        _into_config(path, {"quant_method": "modelopt", **section, "ignore": list(exclude)})


def _into_config(path: Path, qc: dict) -> None:
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    cfg["quantization_config"] = qc
    cfg_file.write_text(json.dumps(cfg), encoding="utf-8")


def reference_model(config, ref_state: dict[str, torch.Tensor], dtype=torch.bfloat16):
    """The same architecture with the decoded float weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    missing, unexpected = model.load_state_dict(
        {k: v.to(dtype) for k, v in ref_state.items()}, strict=False
    )
    missing = [k for k in missing if k != "lm_head.weight"]
    assert not missing and not unexpected, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def step_logits(model, tokens: list[int], prompt: torch.Tensor = PROMPT) -> torch.Tensor:
    """Teacher-forced logits [len(tokens), vocab] that chose each generated token."""
    ids = torch.cat([prompt, torch.tensor([tokens])], dim=1).to(model.device)
    with torch.no_grad():
        logits = model(ids).logits[0].float().cpu()
    return logits[prompt.shape[1] - 1 : -1]


def _routers(model) -> list[torch.nn.Module]:
    return [
        m
        for n, m in model.named_modules()
        if n.endswith((".gate", ".router")) and not isinstance(m, torch.nn.Linear)
    ]


def traced_logits(model, tokens: list[int], prompt: torch.Tensor = PROMPT):
    """Teacher-forced step logits and, per step, the experts every router chose (sorted)."""
    chosen: list[torch.Tensor] = []

    def hook(module, args, out):
        chosen.append(out[-1].reshape(-1, out[-1].shape[-1]).sort(dim=-1).values.cpu())

    handles = [r.register_forward_hook(hook) for r in _routers(model)]
    try:
        logits = step_logits(model, tokens, prompt)
    finally:
        for h in handles:
            h.remove()
    start = prompt.shape[1] - 1
    routing = [c[start : start + len(tokens)] for c in chosen]
    return logits, routing


def assert_matches_reference(model, ref, n: int = 16, *, exact: bool = True, **gen) -> list[int]:
    """Greedy tokens equal the reference's, and the step logits are within the bf16 bound at
    every step where all routers chose the same experts (a near-tied router may flip on bf16
    noise; the two models then legitimately differ at that step).

    ``exact=False`` (the reference holds weights the quantized layers cannot match bit for bit,
    e.g. bf16-rounded dequantized weights): the bound doubles (those roundings add up over the
    layers) and the greedy tokens may part at a step where the reference's two candidates are
    within the bound of each other (a near tie), not elsewhere."""
    got, want = greedy(model, n, **gen), greedy(ref, n)
    la, ra = traced_logits(model, want)
    lb, rb = traced_logits(ref, want)
    bound = (2.0**-5 if exact else 2.0**-4) * float(lb.abs().max())
    if got != want:
        t = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
        margin = float(lb[t, want[t]] - lb[t, got[t]])
        assert not exact and margin <= bound, (got, want, t, margin, bound)
    same = torch.ones(len(want), dtype=torch.bool)
    for x, y in zip(ra, rb, strict=True):
        same &= (x == y).all(dim=-1)
    assert int(same.sum()) >= len(want) - 2, f"routing differs at {int((~same).sum())} steps"
    diff = (la - lb).abs().amax(dim=-1)
    assert float(diff[same].max()) <= bound, (diff.tolist(), bound)
    return got
