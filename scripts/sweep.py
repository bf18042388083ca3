"""The tail the serving benchmarks share: load the model, run one configuration after the other, print each result
as it comes (stderr) and all of them as one JSON document (stdout, and `args.json` when given)."""

from __future__ import annotations

import json
import sys
import time
from typing import Callable, Iterable


def sweep(args, values: Iterable, run: Callable) -> int:
    """`run(model, args, value)` for each of `values`, reported with the device, the date and every argument."""
    import kivi_jax
    from kivi_jax.bench import device_name

    model = kivi_jax.load(args.model, progress=False)  # its tokenizer (a server subprocess loads its own)
    out = {"device": device_name(), "date": time.strftime("%Y-%m-%d"), **{k: v for k, v in vars(args).items()
                                                                           if k != "json"}, "results": []}
    for value in values:
        res = run(model, args, value)
        print(json.dumps(res), file=sys.stderr, flush=True)
        out["results"].append(res)
    text = json.dumps(out, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0
