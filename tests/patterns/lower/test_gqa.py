"""Attention -> GroupQueryAttention, proven equal to the unfused graph on ORT CPU.

Every fused case runs the four scenarios of ``epfuse.optimizer.verify`` (prompt, decode with
a real past, chunked prefill, right-padded batch) on logits and present K/V.
"""

import onnx
import onnx_ir as ir
import pytest
from model_builder import DecoderConfig, build_decoder

import epfuse
from epfuse.optimizer.verify import assert_equivalent
from epfuse.patterns.reasons import ReasonCode


def _gqa_nodes(model: onnx.ModelProto):
    return [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]


def _attrs(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


FUSED = {
    "torch23-full": DecoderConfig(style="torch23"),
    "mobius-full": DecoderConfig(style="mobius"),
    "torch23-interleaved": DecoderConfig(style="torch23", interleaved=True),
    "mobius-interleaved": DecoderConfig(style="mobius", interleaved=True),
    "torch23-partial": DecoderConfig(style="torch23", head_dim=32, rotary_dim=16),
    "mobius-partial": DecoderConfig(style="mobius", head_dim=32, rotary_dim=16),
    "torch23-softcap": DecoderConfig(style="torch23", softcap=5.0),
    "mobius-mqa-softcap": DecoderConfig(style="mobius", kv_heads=1, softcap=3.0),
    "torch23-mha": DecoderConfig(style="torch23", kv_heads=4, layers=1),
}


@pytest.mark.parametrize("name", list(FUSED))
def test_fuses_with_rotary_and_stays_equal(name):
    cfg = FUSED[name]
    original = build_decoder(cfg)
    optimized, report = epfuse.optimize_with_report(original, "cpu")
    nodes = _gqa_nodes(optimized)
    assert len(nodes) == cfg.layers
    assert report.fused_layers == cfg.layers
    for node in nodes:
        attrs = _attrs(node)
        assert attrs["do_rotary"] == 1
        assert attrs["rotary_interleaved"] == int(cfg.interleaved)
        assert attrs["num_heads"] == cfg.heads and attrs["kv_num_heads"] == cfg.kv_heads
        assert attrs.get("softcap", 0.0) == pytest.approx(cfg.softcap)
        assert "rotary_embedding_dim" not in attrs  # ORT rejects unknown attributes
        cos = next(i for i in optimized.graph.initializer if i.name == node.input[7])
        rows = 4096 if cfg.style == "torch23" else cfg.max_positions
        assert list(cos.dims) == [rows, (cfg.rotary_dim or cfg.head_dim) // 2]
    ops = {n.op_type for n in optimized.graph.node}
    assert not ops & {"Attention", "RotaryEmbedding", "Cos", "Sin", "Expand", "GatherND"}
    assert_equivalent(original, optimized)


@pytest.mark.parametrize("style", ["torch23", "mobius"])
def test_gqa_takes_over_the_names_of_what_it_replaces(style):
    """The replace tail is ``_graph.substitute``: GQA's output takes the name of the value it
    replaces (the Attention's output, or the exporter's (B, S, N*H) view of it, whose
    Transpose/Reshape go), and the presents keep theirs."""
    original = build_decoder(DecoderConfig(style=style))
    names = {v for n in original.graph.node for v in n.output}
    optimized = epfuse.optimize(original, "cpu")
    nodes = _gqa_nodes(optimized)
    assert nodes
    for node in nodes:
        assert node.output[0] in names and "GroupQueryAttention" not in node.output[0]
        assert all(name in names for name in node.output[1:])
    assert_equivalent(original, optimized)


def test_sliding_window_becomes_local_window_size():
    cfg = DecoderConfig(style="torch23", sliding_window=4)
    original = build_decoder(cfg)
    optimized = epfuse.optimize(original, "cpu")
    for node in _gqa_nodes(optimized):
        assert _attrs(node)["local_window_size"] == 4
    # prompts and pasts longer than the window, where a dropped window shows
    assert_equivalent(original, optimized, prompt_len=11, decode_past_len=9, chunk_past_len=8)


def test_mobius_sliding_window():
    cfg = DecoderConfig(style="mobius", sliding_window=3)
    original = build_decoder(cfg)
    optimized = epfuse.optimize(original, "cpu")
    assert all(_attrs(n)["local_window_size"] == 3 for n in _gqa_nodes(optimized))
    assert_equivalent(original, optimized, prompt_len=9, decode_past_len=7)


def test_fp16_fuses_and_stays_equal():
    cfg = DecoderConfig(style="torch23", dtype="float16")
    original = build_decoder(cfg)
    optimized = epfuse.optimize(original, "cpu")
    assert len(_gqa_nodes(optimized)) == cfg.layers
    assert_equivalent(original, optimized)


@pytest.mark.parametrize(
    ("cfg", "reason"),
    [
        (DecoderConfig(head_dim=8), "head size 8 is not a multiple of 16"),
        (DecoderConfig(head_dim=16, rotary_dim=8), "cos/sin width 4"),
    ],
)
def test_rotary_outside_gqa_when_cpu_limits_forbid_fusing(cfg, reason):
    original = build_decoder(cfg)
    optimized, report = epfuse.optimize_with_report(original, "cpu")
    nodes = _gqa_nodes(optimized)
    assert len(nodes) == cfg.layers
    assert all(_attrs(n)["do_rotary"] == 0 for n in nodes)
    assert all(len(n.input) <= 7 for n in nodes)  # no cos/sin with do_rotary=0
    assert all(any(reason in r for r in layer.notes) for layer in report.layers)
    assert_equivalent(original, optimized)


@pytest.mark.parametrize("ep", ["dml", "webgpu"])
def test_eps_without_usable_fused_rotary_get_do_rotary_0(ep):
    original = build_decoder(DecoderConfig())
    optimized, report = epfuse.optimize_with_report(original, ep, precision="fp32")
    assert all(_attrs(n)["do_rotary"] == 0 for n in _gqa_nodes(optimized))
    assert all("RoPE kept outside" in " ".join(layer.notes) for layer in report.layers)
    assert_equivalent(original, optimized)


@pytest.mark.parametrize("style", ["torch23", "mobius"])
def test_default_and_cuda_fp32_keep_standard_attention(style):
    original = build_decoder(DecoderConfig(style=style))
    for ep in ("default", "cuda", "coreml"):
        optimized, report = epfuse.optimize_with_report(original, ep, precision="fp32")
        assert not _gqa_nodes(optimized)
        if ep != "cuda":  # CUDA fp32 still gets the norm fusions its record allows
            assert all(n.domain in ("", "ai.onnx") for n in optimized.graph.node)
        assert report.fused_layers == 0
        assert all(ReasonCode.EP_UNSUPPORTED in layer.codes for layer in report.layers)
        assert_equivalent(original, optimized)


def test_cuda_fp16_fuses():
    original = build_decoder(DecoderConfig(dtype="float16"))
    optimized = epfuse.optimize(original, "cuda")
    assert len(_gqa_nodes(optimized)) == 2
    # CUDA's output is also runnable by ORT's CPU GQA kernel for fp16: check it.
    assert_equivalent(original, optimized)


def test_non_causal_mask_is_kept_with_reason():
    model = build_decoder(DecoderConfig(style="mobius"))
    for node in model.graph.node:
        if node.op_type == "Attention":
            for a in node.attribute:
                if a.name == "is_causal":
                    a.i = 0
    optimized, report = epfuse.optimize_with_report(model, "cpu")
    assert not _gqa_nodes(optimized)
    for layer in report.layers:
        assert not layer.fused
        assert ReasonCode.MASK_NOT_PROVEN in layer.codes
    rule = next(r for r in report.rules if r.name == "attention-to-gqa")
    assert ReasonCode.MASK_NOT_PROVEN in rule.kept_codes
    # The codes travel through the JSON report stored in the model, as plain strings.
    stored = epfuse.read_report(optimized)
    assert all("mask-not-proven" in layer.codes for layer in stored.layers)
    assert_equivalent(model, optimized)


def test_report_is_stored_in_metadata():
    optimized = epfuse.optimize(build_decoder(DecoderConfig()), "cpu")
    report = epfuse.read_report(optimized)
    assert report is not None and report.ep == "cpu" and report.fused_layers == 2
    assert any("right-padded" in a for a in report.assumptions)


@pytest.mark.parametrize("style", ["torch23", "mobius"])
def test_bf16_for_cuda_fuses(style):
    """bf16 graphs are analysed through float32 feeds (numpy has no bfloat16)."""
    original = build_decoder(DecoderConfig(style=style, dtype="bfloat16"))
    optimized, report = epfuse.optimize_with_report(original, "cuda")
    assert report.fused_layers == 2
    assert all(_attrs(n)["do_rotary"] == 1 for n in _gqa_nodes(optimized))
    cos = next(
        i for i in optimized.graph.initializer if i.name == _gqa_nodes(optimized)[0].input[7]
    )
    assert cos.data_type == onnx.TensorProto.BFLOAT16


@pytest.mark.parametrize("qk_norm", [False, True])
def test_torchscript_output_view_becomes_the_gqa_output(qk_norm):
    """opset-18 TorchScript exports view the attention output as (B, S, N*H) with a Reshape
    whose target names the declared batch and seq, while inference leaves the output's dims
    anonymous: the query's batch and seq prove the view, so GQA's output replaces it (no
    Transpose/Reshape back to (B, N, S, H) and forward again), and the model stays equal."""
    original = build_decoder(DecoderConfig(style="torch18", qk_norm=qk_norm))
    optimized = epfuse.optimize(original, "cpu")
    ops = [n.op_type for n in optimized.graph.node]
    assert ops.count("GroupQueryAttention") == 2 and "Transpose" not in ops
    assert_equivalent(original, optimized)


def test_an_output_read_otherwise_goes_back_to_bnsh_and_stays_equal():
    """The output-layout fallback: an attention output not read through the exporter's
    (B, S, N*H) view (here an Identity in front of it) gets GQA's output reshaped and
    transposed back to (B, N, S, H)."""
    model = ir.from_proto(build_decoder(DecoderConfig(style="torch18")))
    for node in list(model.graph):
        if node.op_type == "Transpose" and node.inputs[0].name in ("sdpa", "sdpa_1"):
            copy = ir.node("Identity", [node.inputs[0]], name=f"{node.name}/copy")
            copy.outputs[0].name = f"{node.name}/copy_out"
            model.graph.insert_before(node, copy)
            node.replace_input_with(0, copy.outputs[0])
    original = ir.to_proto(model)
    optimized, report = epfuse.optimize_with_report(original, "cpu")
    assert report.fused_layers == 2
    assert any(n.name.endswith("/out/Transpose_1") for n in optimized.graph.node)
    assert_equivalent(original, optimized)
