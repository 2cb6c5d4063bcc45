"""PNG plots of bench results (matplotlib, `pip install kvfleet[bench]`): latency CDFs, throughput and TTFT
against the offered rate, KV usage and prefix-hit rate over time."""

from __future__ import annotations

from pathlib import Path

from kvfleet.bench.records import RequestRecord


def _plt():
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("--plots needs matplotlib: pip install 'kvfleet[bench]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _label(res: dict, run: dict) -> str:
    return f"{res['name']} {res['scenario']} {run['load']}"


def write_plots(results: list[dict], out_dir: str | Path) -> list[Path]:
    plt = _plt()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for res in results:
        for run in res["runs"]:
            recs = [RequestRecord.from_json(d) for d in run.get("records", [])]
            for ax, xs in ((axes[0], [r.ttft_s * 1e3 for r in recs if r.ok and r.ttft_s is not None]),
                           (axes[1], [r.end_s * 1e3 for r in recs if r.ok])):
                xs = sorted(xs)
                if xs:
                    ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], drawstyle="steps-post",
                            label=_label(res, run))
    for ax, what in zip(axes, ("TTFT", "end-to-end latency"), strict=True):
        ax.set_xlabel(f"{what} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{what} CDF")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    written.append(_save(fig, out_dir / "latency_cdf.png", plt))

    swept = [r for r in results if sum(run.get("rate") is not None for run in r["runs"]) >= 2]
    if swept:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for res in swept:
            runs = sorted((run for run in res["runs"] if run.get("rate") is not None), key=lambda x: x["rate"])
            rates = [run["rate"] for run in runs]
            axes[0].plot(rates, [run["summary"]["output_tok_s"] for run in runs], "o-", label=res["name"])
            axes[1].plot(rates, [run["summary"]["ttft_ms"]["p50"] for run in runs], "o-", label=f"{res['name']} p50")
            axes[1].plot(rates, [run["summary"]["ttft_ms"]["p99"] for run in runs], "x--", label=f"{res['name']} p99")
        axes[0].set_ylabel("output tokens/s")
        axes[1].set_ylabel("TTFT (ms)")
        for ax in axes:
            ax.set_xlabel("offered rate (requests/s)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        written.append(_save(fig, out_dir / "rate_sweep.png", plt))

    series = [(res, run) for res in results for run in res["runs"] if (run.get("fleet") or {}).get("series")]
    if series:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for res, run in series:
            pts = run["fleet"]["series"]
            axes[0].plot([p["t_s"] for p in pts], [p["kv_usage"] for p in pts], label=_label(res, run))
            hits = [p for p in pts if p["hit_rate"] is not None]
            axes[1].plot([p["t_s"] for p in hits], [p["hit_rate"] for p in hits], label=_label(res, run))
        for ax, what in zip(axes, ("KV cache usage (mean over engines)", "prefix-cache hit rate per interval"),
                            strict=True):
            ax.set_xlabel("seconds into the run")
            ax.set_title(what)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        axes[1].set_ylim(0, 1.05)
        axes[0].legend(fontsize=7)
        written.append(_save(fig, out_dir / "fleet_over_time.png", plt))
    return written


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
