"""`kvfleet bench` (with `kvfleet profile` and `kvfleet capacity` beside it: kvfleet/profile.py,
kvfleet/capacity.py): judge a serving stack on your traffic's shape.

| file | holds |
|---|---|
| cli.py | `kvfleet bench run / report / matrix` |
| scenarios.py | the stress-matrix presets, ShareGPT-like lengths, trace replay (ours and Mooncake's) |
| runner.py | kvfleet's own streaming driver: closed loop, Poisson open loop, trace times, multi-turn sessions |
| guidellm_driver.py | the same presets and loads sent by guidellm (a driven subprocess), read back as records |
| records.py, metrics.py | one request's record from its SSE stream; TTFT/TPOT/ITL/E2E percentiles, goodput |
| fleet_metrics.py | prefix-cache hit rate and KV usage over the run, from the engines' vLLM-style /metrics |
| report.py, plots.py | the side-by-side Markdown table; latency CDFs, rate sweeps, KV/hit rate over time (PNG) |
| matrix.py | the stress matrix on the local fleet vs one engine vs vLLM-CPU |
| targets.py | a target server's turn (started, ready, stopped); vLLM-CPU's start command |
| ../profile.py, ../capacity.py | a trace's shape; KV bytes per token, sequences that fit, replicas needed |

What comes from guidellm and what is ours. guidellm 0.8.1 is a complete load generator: Poisson/constant
rates, concurrent streams, sweeps, synthetic data with shared prefixes and multi-turn conversations (it
resends live history), Mooncake and other trace replays, per-request timings and its own goodput. It runs
from its own venv as a subprocess: pip's resolver co-installs it with kvfleet, but it pins `click~=8.4.0`
(downgrading click here) and adds ~30 packages (datasets, pyarrow, pandas, sanic, ...) to an environment
that also serves. `--driver guidellm` hands it the load and the preset (as guidellm synthetic data) and
reads its JSON report back. What kvfleet writes itself, because guidellm does not give it in this form:
the stress-matrix presets (RAG with a template and a pool of retrieved chunks, parallel sampling n > 1),
a driver whose records keep every chunk's arrival time (exact ITL and goodput under our SLO, tested from
recorded streams) and that sends a session header routers can use, the fleet's hit rate and KV usage
from /metrics (engines found through a kvfleet router), the side-by-side report across targets, the
matrix over kvfleet's fleet / one engine / vLLM-CPU, and `profile` / `capacity`.
"""
