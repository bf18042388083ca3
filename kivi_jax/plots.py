"""PNG plots of benchmark and ablation results (matplotlib, imported only when a plot is asked for)."""

from __future__ import annotations

from kivi_jax.config import is_reference


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install 'kivi-jax[plot]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(path)


def plot_decode(rows: list[dict], title: str, path) -> str:
    """Decode-step time (median, min-max bars) against context, one line per cache spec and batch; the ratio
    against the full-precision cache beside it."""
    plt = _pyplot()
    fig, (ax, ax_r) = plt.subplots(1, 2, figsize=(11, 4.2))
    for cache in dict.fromkeys(r["cache"] for r in rows):
        for batch in dict.fromkeys(r["batch"] for r in rows):
            pts = sorted((r for r in rows if r["cache"] == cache and r["batch"] == batch), key=lambda r: r["context"])
            if not pts:
                continue
            x = [r["context"] for r in pts]
            y = [r["step_ms_median"] for r in pts]
            err = [[r["step_ms_median"] - r["step_ms_min"] for r in pts], [r["step_ms_max"] - r["step_ms_median"] for r in pts]]
            line = ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=f"{cache}, batch {batch}")
            if pts[0].get("ratio_vs_full") is not None and not is_reference(cache):
                ax_r.plot(x, [r["ratio_vs_full"] for r in pts], marker="o", color=line[0].get_color(),
                          label=f"{cache}, batch {batch}")
    for a in (ax, ax_r):
        a.set_xscale("log", base=2)
        a.set_xlabel("context (tokens in the cache)")
        a.grid(alpha=0.3)
    ax.set_ylabel("decode step (ms, median; bars min-max)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax_r.axhline(1.0, color="gray", lw=1)
    ax_r.set_ylabel("step time / full-precision step time")
    ax_r.set_title("ratio vs full (same run)")
    if ax_r.lines[1:]:
        ax_r.legend(fontsize=8)
    return _save(fig, path)


def plot_memory(curves: dict, budgets: dict, title: str, path) -> str:
    """Cache bytes per sequence against context (`curves`: spec -> [(context, bytes)]) and the largest batch per
    memory budget (`budgets`: budget label -> {spec: max batch})."""
    plt = _pyplot()
    fig, (ax, ax_b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for spec, pts in curves.items():
        ax.plot([c for c, _ in pts], [b / 2**30 for _, b in pts], marker="o", label=spec)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("cache bytes per sequence (GiB)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    labels = list(budgets)
    specs = list(dict.fromkeys(s for b in budgets.values() for s in b))
    width = 0.8 / max(len(specs), 1)
    for i, spec in enumerate(specs):
        xs = [j + (i - (len(specs) - 1) / 2) * width for j in range(len(labels))]
        vals = [budgets[b].get(spec, 0) for b in labels]
        bars = ax_b.bar(xs, vals, width, label=spec)
        ax_b.bar_label(bars, fontsize=7)
    ax_b.set_xticks(range(len(labels)), labels)
    ax_b.set_xlabel("memory budget (weights + caches)")
    ax_b.set_ylabel("largest batch")
    ax_b.set_title("max batch per budget")
    ax_b.legend(fontsize=8)
    return _save(fig, path)


def plot_generate(rows: list[dict], title: str, path) -> str:
    """Generation throughput (new tokens/s) against batch size, one line per cache spec."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for cache in dict.fromkeys(r["cache"] for r in rows):
        pts = sorted((r for r in rows if r["cache"] == cache), key=lambda r: r["batch"])
        ax.plot([r["batch"] for r in pts], [r["tokens_per_s"] for r in pts], marker="o", label=cache)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("new tokens / s (prefill included)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_ablation(rows: list[dict], title: str, path) -> str:
    """ΔNLL per configuration as bars grouped by study, the windows' range as whiskers (`evaluate.ablation_rows`)."""
    plt = _pyplot()
    rows = [r for r in rows if not is_reference(r["spec"])]
    studies = list(dict.fromkeys(r["study"] for r in rows))
    colors = dict(zip(studies, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(rows) + 1.4))
    y = list(range(len(rows)))[::-1]
    mean = [r["delta_nll"] for r in rows]
    err = [[r["delta_nll"] - r["delta_min"] for r in rows], [r["delta_max"] - r["delta_nll"] for r in rows]]
    ax.barh(y, mean, xerr=err, color=[colors[r["study"]] for r in rows], capsize=2)
    ax.set_yticks(y, [f"{r['study']}: {r['spec']}" for r in rows], fontsize=8)
    ax.set_xlabel("ΔNLL vs full precision (nats/token); bars: mean, whiskers: windows' range")
    ax.set_title(title, fontsize=9)
    ax.axvline(0, color="black", linewidth=0.5)
    return _save(fig, path)


KIVI_STUDIES = ("reference", "axes", "group size", "residual", "bits")  # KIVI's own sweep


def plot_tradeoff(rows: list[dict], title: str, path) -> str:
    """ΔNLL against bits a cached value for every configuration with a bit count: KIVI's own sweep (bits, G, R), the
    beyond-KIVI configurations, the presets, and a peer's (transformers' quanto cache) when given; log ΔNLL."""
    plt = _pyplot()
    rows = [r for r in rows if r.get("bits") is not None and not is_reference(r["spec"])]
    kinds = {"presets": lambda r: r["study"] == "presets",  # first: a preset also on the combined path is a preset
             "KIVI (bits, G, R, axes)": lambda r: r["study"] in KIVI_STUDIES,
             "beyond KIVI": lambda r: r["study"].startswith("beyond") or r["study"] == "other",
             "transformers + quanto": lambda r: r["study"] == "peer"}
    markers = dict(zip(kinds, ("*", "o", "s", "^")))
    fig, ax = plt.subplots(figsize=(8, 5))
    seen = set()
    for kind, member in kinds.items():
        pts = [r for r in rows if member(r) and r["spec"] not in seen]
        seen |= {r["spec"] for r in pts}
        if not pts:
            continue
        ax.scatter([r["bits"] for r in pts], [max(r["delta_nll"], 1e-4) for r in pts], marker=markers[kind],
                   s=90 if kind == "presets" else 30, label=kind, zorder=3)
        for r in pts:
            ax.annotate(r["spec"], (r["bits"], max(r["delta_nll"], 1e-4)), fontsize=6, xytext=(3, 2),
                        textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("bits a cached value (codes + scales + mins + sinks; keys and values averaged)")
    ax.set_ylabel("ΔNLL vs full precision (nats/token, log; ≤ 1e-4 drawn at 1e-4)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_longctx(report: dict, title: str, path) -> str:
    """The long-context evaluation (`longctx.report`): accuracy against prompt length per spec for each retrieval
    task, and ΔNLL against context length per quantized spec (long-document loss)."""
    plt = _pyplot()
    tasks = list(report["retrieval"])
    labels = report.get("labels", {})  # a preset's name beside its spec
    panels = len(tasks) + bool(report["longdoc"])
    fig, axes = plt.subplots(1, max(panels, 1), figsize=(5.2 * max(panels, 1), 4.2), squeeze=False)
    axes = list(axes[0])
    for ax, task in zip(axes, tasks):
        for spec, rows in report["retrieval"][task].items():
            pts = sorted((int(n), r["accuracy"]) for n, r in rows.items())
            if pts:
                ax.plot([n for n, _ in pts], [a for _, a in pts], marker="o", label=labels.get(spec, spec),
                        linestyle="--" if is_reference(spec) else "-", color="black" if is_reference(spec) else None)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("accuracy (exact match)")
        ax.set_title(f"{task}: {title}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if report["longdoc"]:
        ax = axes[len(tasks)]
        for spec, rows in report["longdoc"].items():
            pts = sorted((int(c), r["delta_nll"]) for c, r in rows.items() if r["delta_nll"] is not None)
            if not is_reference(spec) and pts:
                ax.plot([c for c, _ in pts], [d for _, d in pts], marker="o", label=labels.get(spec, spec))
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_xlabel("context before the scored tokens (tokens)")
        ax.set_ylabel("ΔNLL vs full precision (nats/token)")
        ax.set_title(f"long-document loss: {title}", fontsize=9)
        ax.grid(alpha=0.3)
        if ax.lines[1:]:
            ax.legend(fontsize=8)
    return _save(fig, path)
