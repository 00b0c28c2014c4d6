"""Load any OpenAI-compatible server with chat sessions at several Poisson rates.

    python -m llmsys serve --model smollm2 &                      # the course's server
    python benchmarks/serve_load.py --base-url http://127.0.0.1:8000/v1 --model smollm2

It reports, per rate: requests served and failed (429s included), output tokens/s, TTFT,
TPOT and ITL at p50 and p99, the share meeting the SLO (TTFT <= 1 s, TPOT <= 100 ms by
default), goodput (such requests per second) and the server's prefix-cache hit rate (from
its /metrics; blank for servers that name it differently). The trace and the metrics are
described in ``llmsys.serving.load``.

The script speaks only the OpenAI API, so on a GPU machine point the same command at vLLM
(`vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --port 8000`) or SGLang
(`python -m sglang.launch_server --model-path ... --port 8000`) and compare with the
course's engine on the same trace. Loopback addresses only; bounded by --requests per rate
and --max-seconds.
"""

from __future__ import annotations

import argparse
import json
import sys

from llmsys.serving.load import check_loopback, sweep, sweep_table


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="model name (default: the first the server lists)")
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1, 2, 4], help="requests per second")
    p.add_argument("--requests", type=int, default=24, help="requests per rate")
    p.add_argument("--max-seconds", type=float, default=120, help="stop sending after this long, per rate")
    p.add_argument("--ttft-slo", type=float, default=1.0)
    p.add_argument("--tpot-slo", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    try:
        check_loopback(args.base_url)
        if min(args.rates) <= 0 or args.requests < 1 or args.max_seconds <= 0:
            raise ValueError("--rates, --requests and --max-seconds must be positive")
    except ValueError as e:
        p.exit(2, f"error: {e}\n")
    model = args.model
    if model is None:
        import openai

        try:
            model = openai.OpenAI(base_url=args.base_url, api_key="none", max_retries=0).models.list().data[0].id
        except openai.APIConnectionError:
            p.exit(1, f"error: no server answers at {args.base_url}; start one, e.g. python -m llmsys serve\n")
    rows = sweep(args.base_url, model, sorted(args.rates), args.requests, args.max_seconds, args.seed,
                 ttft_slo=args.ttft_slo, tpot_slo=args.tpot_slo)
    print(f"{model} at {args.base_url}; SLO: TTFT <= {args.ttft_slo} s, TPOT <= {args.tpot_slo} s")
    print(sweep_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "base_url": args.base_url, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
