"""How fast the declared rotate-half match runs: epfuse's matcher vs onnxscript's.

The rotate-half RoPE shape (``epfuse.patterns.canonicalize.rotate_half._ROPE``: x*cos +
rotated*sin, each product and the sum in either order, rotate-half or rotate-every-two,
cos/sin broadcast over heads or GLM's pairwise halves) is matched at every Add of test
decoders (``build_decoder(style="torch18")``, 4 to 128 layers) by

* ``epfuse``: ``epfuse.patterns.matcher.match`` (one op tree, backtracking);
* ``onnxscript``: the same op tree as an ``onnxscript.rewriter.pattern`` (``OrValue`` for
  the alternatives, the commuted copies ``Pattern.commute`` makes for Add/Mul), its
  ``Pattern.match`` tried per copy until one matches (as ``RewriteRuleSet(commute=True)``
  does); the same ``_valid`` checks run on its bindings.

Both must find the same matches (two per layer: q and k). Times are the best of
``--repeat`` sweeps; the per-anchor column shows whether the cost stays linear.

    python benchmarks/matching.py            # 4, 16, 64, 128 layers
    python benchmarks/matching.py --quick    # 4 and 16 layers
"""

from __future__ import annotations

import argparse
import json
import os
import time

import _common  # noqa: F401 (puts the checkout on sys.path)
import onnx_ir as ir


def _onnxscript_patterns():
    from onnxscript.rewriter import pattern as orp

    def trig(op, c, name):
        heads = op.Unsqueeze(c, orp.Var(f"{name}_axes"), _outputs=[f"{name}/heads"])
        first = op.Slice(heads, _allow_other_inputs=True, _outputs=[f"{name}/first"])
        expand = op.Expand(
            op.Unsqueeze(first, orp.Var(f"{name}_axes2")),
            orp.Var(f"{name}/repeat"),
            _outputs=[f"{name}/expand"],
        )
        repeated = op.Reshape(expand, orp.Var(f"{name}_shape"), _outputs=[f"{name}/repeated"])
        return orp.OrValue([heads, repeated], tag_var=f"{name}_kind", tag_values=[0, 1])

    def rope(op, x, cos_full, sin_full):
        second = op.Slice(x, _allow_other_inputs=True, _outputs=["second"])
        first = op.Slice(x, _allow_other_inputs=True, _outputs=["first"])
        half = op.Concat(op.Neg(second), first, _outputs=["half"])
        odd = op.Slice(x, _allow_other_inputs=True, _outputs=["odd"])
        even = op.Slice(x, _allow_other_inputs=True, _outputs=["even"])
        pairs = op.Concat(
            op.Unsqueeze(op.Neg(odd), orp.Var("odd_axes")),
            op.Unsqueeze(even, orp.Var("even_axes")),
            _outputs=["pairs"],
        )
        two = op.Reshape(pairs, orp.Var("two_shape"), _outputs=["rotated"])
        rotated = orp.OrValue([half, two], tag_var="kind", tag_values=[0, 1])
        cos4, sin4 = trig(op, cos_full, "cos_full"), trig(op, sin_full, "sin_full")
        return op.Add(op.Mul(x, cos4), op.Mul(rotated, sin4))

    from onnxscript.rewriter._pattern_ir import _to_graph_pattern
    from onnxscript.rewriter._rewrite_rule import Pattern

    graph_pattern = _to_graph_pattern(rope)
    return [Pattern(p, _onnxscript_condition) for p in graph_pattern.commute()]


def _onnxscript_condition(context, **bindings) -> bool:
    """The same checks as epfuse's ``_valid``, on onnxscript's bindings (its op trees carry no
    attribute or constant predicates here, so those are tested first)."""
    from epfuse.patterns import matcher
    from epfuse.patterns._graph import attr, const_array, const_ints
    from epfuse.patterns.canonicalize import rotate_half

    m = matcher.Match()
    for name, value in bindings.items():
        if isinstance(value, ir.Value):
            m._values[name] = value
            node = value.producer()
            names = ("first", "second", "odd", "even", "rotated", "half", "pairs")
            if node is not None and ("/" in name or name in names):
                m._names[name] = node
    for name in ("cos_full", "sin_full"):
        if bindings.get(f"{name}_kind") == 0:
            m._names.pop(f"{name}/repeated", None)
        if const_ints(bindings.get(f"{name}_axes")) not in ([1], [-3]):
            return False
        if bindings.get(f"{name}_kind") == 1:
            if const_ints(bindings.get(f"{name}_axes2")) not in ([-1], [4]):
                return False
            if not rotate_half._pair_repeat(const_array(bindings[f"{name}/repeat"]), 5):
                return False
    if bindings.get("kind") == 0:
        m._names.pop("rotated", None)
        if attr(m.node("half"), "axis") not in (-1, 3):
            return False
    else:
        if attr(m.node("pairs"), "axis") not in (-1, 4):
            return False
        if const_ints(bindings.get("odd_axes")) not in ([-1], [4]):
            return False
        if const_ints(bindings.get("even_axes")) not in ([-1], [4]):
            return False
    return rotate_half._valid(m)


def _sweep(model: ir.Model, how: str, patterns) -> tuple[float, int]:
    from epfuse.patterns import matcher
    from epfuse.patterns.canonicalize import rotate_half

    anchors = [n for n in model.graph if n.op_type == "Add"]
    start = time.perf_counter()
    found = 0
    for node in anchors:
        if how == "epfuse":
            found += matcher.match(rotate_half._ROPE, node, where=rotate_half._valid) is not None
        elif how == "hand":
            found += patterns(node) is not None
        else:
            for p in patterns:
                if p.match(model, model.graph, node, check_nodes_are_removable=False):
                    found += 1
                    break
    return time.perf_counter() - start, found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--hand",
        help="module:callable of a hand-written match to time as well (node -> match or None)",
    )
    args = parser.parse_args()
    from epfuse.optimizer.manager import _infer_types
    from epfuse.testing.model_builder import DecoderConfig, build_decoder

    hows = {"epfuse": None, "onnxscript": _onnxscript_patterns()}
    if args.hand:
        import importlib

        module, _, name = args.hand.partition(":")
        target = importlib.import_module(module)
        for part in name.split("."):
            target = getattr(target, part)
        hows["hand"] = target
    rows = []
    print(f"# load average {os.getloadavg()[0]:.2f}")
    print(
        "| layers | nodes | Add anchors | matches | "
        + " | ".join(f"{h} ms (us/anchor)" for h in hows)
        + " |"
    )
    print("|---" * (4 + len(hows)) + "|")
    for layers in (4, 16) if args.quick else (4, 16, 64, 128):
        proto = build_decoder(DecoderConfig(layers=layers, style="torch18"))
        model = proto if isinstance(proto, ir.Model) else ir.serde.deserialize_model(proto)
        _infer_types(model)  # as the optimizer does first: the checks read static widths
        anchors = sum(1 for n in model.graph if n.op_type == "Add")
        row = {"layers": layers, "nodes": len(model.graph), "anchors": anchors}
        cells, counts = [], set()
        for how, patterns in hows.items():
            best, found = min(_sweep(model, how, patterns) for _ in range(args.repeat))
            counts.add(found)
            row[how] = best
            cells.append(f"{best * 1e3:.1f} ({best / anchors * 1e6:.0f})")
        if len(counts) != 1:
            raise SystemExit(f"the matchers disagree at {layers} layers: {counts}")
        row["matches"] = counts.pop()
        rows.append(row)
        print(
            f"| {layers} | {row['nodes']} | {anchors} | {row['matches']} | "
            + " | ".join(cells)
            + " |"
        )
    print(f"# load average {os.getloadavg()[0]:.2f}")
    name = "matching-quick.json" if args.quick else "matching.json"
    path = os.path.join(os.path.dirname(__file__), "results", name)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
