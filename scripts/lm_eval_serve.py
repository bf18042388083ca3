"""lm-evaluation-harness against `kivi-jax serve`, one server per cache spec, a table into docs/quality.md.

    python scripts/lm_eval_serve.py --caches full,kivi2,kivi2+,kivi3+ --limit 100 --write docs/quality.md
    python scripts/lm_eval_serve.py --caches full --limit 100 --hf-check      # lm-eval's own HF backend beside it

lm-eval (`lm-eval` on the package index) is never a dependency of kivi_jax: it is installed on first use into its own
venv under the kivi_jax cache dir (`$KIVI_JAX_CACHE/lm-eval/venv`, with its `hf` extra for --hf-check). Each spec gets
a fresh `kivi-jax serve` subprocess on a free loopback port; lm-eval reaches it through `local-completions`
(log-likelihoods through `echo` + `logprobs`, generations through plain completions), with the served model's own
tokenizer, so the token ids lm-eval scores are the ones the server reads.

The tasks are lm-eval custom-task YAML over local JSONL files made here from text every Python ships (the prose of
`pydoc_data.topics`, kivi_jax's evaluation text; the hub's datasets are unreachable on this machine):
- `kivi_pydoc_cloze` (log-likelihood, LAMBADA-style): about 200 tokens of the prose, then the next word; accuracy
  (the word is the greedy continuation, token by token) and word perplexity. The contexts are longer than a KIVI ring
  (R = 128), so the word is predicted from a cache whose oldest blocks are quantized.
- `kivi_pydoc_passcode` (generation): a five-digit pass code, about 230 tokens of the prose, then "The pass code is";
  exact match of the first number generated (greedy, at most 8 tokens). The code sits in quantized blocks when the
  digits after the first are decoded.

With network access, any of lm-eval's standard tasks runs the same way: start `kivi-jax serve --cache SPEC
--served-model-name smollm2`, then `lm_eval --model local-completions --model_args
model=smollm2,base_url=http://127.0.0.1:8000/v1/completions,num_concurrent=8,tokenized_requests=True,
tokenizer=<the model's tokenizer dir> --tasks lambada_openai,hellaswag,arc_easy` (or pass `--tasks` here).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LM_EVAL = "lm-eval==0.4.13"
TASKS = ("kivi_pydoc_cloze", "kivi_pydoc_passcode")
BEGIN, END = "<!-- lm-eval-serve:begin -->", "<!-- lm-eval-serve:end -->"
CLOZE_TOKENS = 200  # context tokens of a cloze item (past one ring of R = 128)
PASSCODE_TOKENS = 230  # filler tokens between the pass code and the question


def log(msg: str) -> None:
    print(f"[lm_eval_serve {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    from kivi_jax.hub import cache_root

    return cache_root()


# ---------------------------------------------------------------------------------------------------------------------
# lm-eval in its own venv


def lm_eval_venv(hf: bool) -> Path:
    """The venv holding lm-eval (made on first use), its `bin/` directory returned."""
    venv = cache_root() / "lm-eval" / "venv"
    py = venv / "bin" / "python"
    if not py.exists():
        log(f"making a venv for lm-eval at {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    name, version = LM_EVAL.split("==")
    need = f"{name}[api{',hf' if hf else ''}]=={version}"  # api: local-completions; hf: its transformers backend
    have = subprocess.run([str(py), "-c", "import lm_eval, tenacity, aiohttp" + (", torch, transformers" if hf else "")],
                          capture_output=True)
    if have.returncode != 0:
        log(f"installing {need} into {venv} (once)")
        subprocess.run([str(py), "-m", "pip", "install", "-q", need], check=True)
    return venv / "bin"


# ---------------------------------------------------------------------------------------------------------------------
# The tasks, from pydoc_data.topics


def make_tasks(tokenizer, out: Path, docs: int) -> Path:
    """JSONL data and lm-eval task YAML for TASKS under `out` (deterministic: evenly spaced over the text)."""
    from kivi_jax.evaluate import default_text

    out.mkdir(parents=True, exist_ok=True)
    text = default_text()
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    offsets = enc["offset_mapping"]  # [(start, end)] characters of each token
    n = len(offsets)

    def words_after(char: int):
        """The first word of 5+ letters starting at or after `char`: (its start, the word)."""
        m = re.compile(r"(?<![A-Za-z_.])([A-Za-z]{5,})(?![A-Za-z_(])").search(text, char)
        return (m.start(1), m.group(1)) if m else (None, None)

    cloze, passcode = [], []
    span = n - 2 * (CLOZE_TOKENS + PASSCODE_TOKENS)
    for i in range(docs):
        t = CLOZE_TOKENS + i * span // docs  # the token the cloze context ends near
        start, word = words_after(offsets[t][0])
        if word is None:
            continue
        # the context: whole tokens ending at the word's preceding space, about CLOZE_TOKENS of them
        first = max(0, t - CLOZE_TOKENS)
        context = text[offsets[first][0] : start]
        if not context.endswith(" "):
            continue
        cloze.append({"context": context[:-1], "target": " " + word})
    for i in range(docs):
        t = i * (n - PASSCODE_TOKENS - 1) // docs
        filler = text[offsets[t][0] : offsets[t + PASSCODE_TOKENS][0]].strip()
        code = f"{(7919 * (i + 3) * 104729) % 90000 + 10000}"
        passcode.append({"context": f"The pass code is {code}. Remember it.\n\n{filler}\n\nWhat is the pass code? "
                                    "The pass code is", "answer": code})
    for name, rows in (("cloze", cloze), ("passcode", passcode)):
        with open(out / f"{name}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    (out / "kivi_pydoc_cloze.yaml").write_text(f"""task: kivi_pydoc_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: {out / 'cloze.jsonl'}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    (out / "kivi_pydoc_passcode.yaml").write_text(f"""task: kivi_pydoc_passcode
dataset_path: json
dataset_kwargs:
  data_files:
    test: {out / 'passcode.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
filter_list:
  - name: first_number
    filter:
      - function: regex
        regex_pattern: "(\\\\d+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    log(f"tasks in {out}: {len(cloze)} cloze items, {len(passcode)} pass-code items")
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Running


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(spec: str, model: str, port: int, slots: int, max_length: int, logfile: Path) -> subprocess.Popen:
    cmd = ["nice", "-n", "10", sys.executable, "-m", "kivi_jax.cli", "serve", "--model", model, "--cache", spec,
           "--slots", str(slots), "--max-length", str(max_length), "--port", str(port), "--served-model-name",
           "smollm2", "--max-queue", "256"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log(f"{spec}: {' '.join(cmd[3:])}")
    return launch(cmd, port, f"kivi-jax serve --cache {spec}", logfile, env, timeout=900)


def launch(cmd: list[str], port: int, name: str, logfile: Path, env: dict | None = None,
           timeout: float = 1200) -> subprocess.Popen:
    """The server `cmd` as a subprocess in its own session (no controlling terminal: nothing can stop it), run from
    the repository root with its output in `logfile`, once it answers /health on `port` (`wait_healthy`)."""
    proc = subprocess.Popen(cmd, stdout=logfile.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            cwd=ROOT, start_new_session=True)
    wait_healthy(proc, port, name, logfile, timeout)
    return proc


def stop(proc: subprocess.Popen, grace: float = 60) -> None:
    """Ends a server `launch` started: SIGTERM (it drains), then SIGKILL if it has not exited in `grace` s."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()


def wait_healthy(proc: subprocess.Popen, port: int, name: str, logfile: Path, timeout: float = 1200) -> None:
    """Returns once the server `proc` answers /health on `port`; RuntimeError if it exits or takes `timeout` s."""
    import urllib.request

    t0 = time.time()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited ({proc.returncode}); see {logfile}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.time() - t0 > timeout:
            proc.terminate()
            raise RuntimeError(f"{name} did not answer /health in {timeout:.0f} s; see {logfile}")
        time.sleep(2)


def run_lm_eval(bin_dir: Path, model_args: list[str], backend: str, tasks: list[str], include: Path | None,
                limit: int | None, out: Path, extra_env: dict | None = None) -> dict:
    cmd = ["nice", "-n", "10", str(bin_dir / "lm_eval"), "--model", backend, "--model_args", ",".join(model_args),
           "--tasks", ",".join(tasks), "--output_path", str(out), "--batch_size", "1"]
    if include is not None:
        cmd += ["--include_path", str(include)]
    if limit:
        cmd += ["--limit", str(limit)]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           **(extra_env or {})}
    log(" ".join(cmd[3:]))
    t0 = time.time()
    subprocess.run(cmd, check=True, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    results = sorted(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not results:
        raise RuntimeError(f"lm-eval wrote no results under {out}")
    data = json.loads(results[-1].read_text())
    data["wall_seconds"] = round(time.time() - t0, 1)
    return data


def metrics_of(data: dict) -> dict:
    """{task: {metric: (value, stderr)}} from an lm-eval results file."""
    out = {}
    for task, res in data["results"].items():
        row = {}
        for key, value in res.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            stderr = res.get(f"{metric}_stderr,{filt}")
            row[metric] = (value, stderr if isinstance(stderr, (int, float)) else None)
        out[task] = row
    return out


def hf_model_dir(tokenizer_dir: Path) -> Path:
    """SmolLM2 as a transformers directory (float32, from the same GGUF), for lm-eval's HF backend."""
    out = cache_root() / "lm-eval" / "smollm2-hf"
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = cache_root() / "smollm2" / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    log(f"writing {out} from {gguf}")
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to save a model it loaded from a GGUF ("quantized with gguf"): its weights are already
    # dequantized to float32, so copy them into a plain model of the same config, without the GGUF marker
    config = loaded.config
    del config.quantization_config
    model = type(loaded)(config).to(torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(tmp)
    try:
        tmp.rename(out)  # whole or absent: a concurrent or interrupted run never leaves half a directory at `out`
    except OSError:  # another run wrote it meanwhile: keep theirs
        if not (out / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def fmt(value, stderr) -> str:
    return f"{value:.4f}" if stderr is None else f"{value:.4f} ± {stderr:.4f}"


def table(rows: list[tuple[str, dict]], tasks: list[str]) -> str:
    columns = [(t, m) for t in tasks for m in sorted({m for _, r in rows for m in r.get(t, {})})]
    head = "| run | " + " | ".join(f"{t.replace('kivi_pydoc_', '')} {m}" for t, m in columns) + " |"
    lines = [head, "|---|" + "---:|" * len(columns)]
    for name, r in rows:
        cells = [fmt(*r[t][m]) if t in r and m in r[t] else "-" for t, m in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_section(path: Path, body: str) -> None:
    text = path.read_text() if path.exists() else ""
    block = f"{BEGIN}\n{body}\n{END}"
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--caches", default="full,kivi2,kivi2+,kivi3+", help="cache specs, comma-separated (\"\" with --hf-check: that backend alone)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tasks", default=",".join(TASKS),
                   help="lm-eval tasks (default: the two local tasks made here; standard ones need the hub)")
    p.add_argument("--docs", type=int, default=200, help="items written for each local task (default 200)")
    p.add_argument("--limit", type=int, default=100, help="items lm-eval runs per task (default 100; 0 = all)")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--num-concurrent", type=int, default=8)
    p.add_argument("--hf-check", action="store_true", help="also run lm-eval's HF backend on the same model")
    p.add_argument("--write", type=Path, default=None, help="put the table into this markdown file (docs/quality.md)")
    p.add_argument("--out", type=Path, default=None, help="where lm-eval writes (default: the cache dir)")
    args = p.parse_args(argv)

    import kivi_jax

    work = args.out or cache_root() / "lm-eval" / "runs" / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    bin_dir = lm_eval_venv(args.hf_check)
    from kivi_jax.hub import ensure_checkpoint

    if args.model == "smollm2":
        tokenizer_dir = ensure_checkpoint("smollm2") / "tokenizer"  # the tokenizer kivi_jax built from the GGUF
    else:
        tokenizer_dir = work / "tokenizer"
        kivi_jax.load(args.model, progress=False).tokenizer.save_pretrained(tokenizer_dir)
    from transformers import AutoTokenizer

    tasks = args.tasks.split(",")
    include = make_tasks(AutoTokenizer.from_pretrained(str(tokenizer_dir)), work / "tasks", args.docs) \
        if set(tasks) & set(TASKS) else None
    rows, raw = [], {}
    for spec in [s for s in args.caches.split(",") if s]:  # `--caches ""`: only --hf-check
        port = free_port()
        server = start_server(spec, args.model, port, args.slots, args.max_length, work / f"serve-{spec}.log")
        try:
            model_args = ["model=smollm2", f"base_url=http://127.0.0.1:{port}/v1/completions",
                          f"num_concurrent={args.num_concurrent}", "max_retries=1", "tokenized_requests=True",
                          f"tokenizer={tokenizer_dir}", "tokenizer_backend=huggingface", "timeout=3600"]
            data = run_lm_eval(bin_dir, model_args, "local-completions", tasks, include, args.limit,
                               work / f"lm-eval-{spec}")
        finally:
            server.terminate()
            server.wait(60)
        raw[spec] = data
        rows.append((f"serve `{spec}`", metrics_of(data)))
        log(f"{spec}: {json.dumps(metrics_of(data))} in {data['wall_seconds']} s")
    if args.hf_check:
        hf = hf_model_dir(tokenizer_dir)
        data = run_lm_eval(bin_dir, [f"pretrained={hf}", "dtype=float32"], "hf", tasks, include,
                           args.limit, work / "lm-eval-hf", {"OMP_NUM_THREADS": "2"})
        raw["hf"] = data
        rows.append(("lm-eval `hf` backend (transformers, float32)", metrics_of(data)))
        log(f"hf: {json.dumps(metrics_of(data))} in {data['wall_seconds']} s")
    (work / "summary.json").write_text(json.dumps({k: {"results": v["results"], "wall_seconds": v["wall_seconds"]}
                                                   for k, v in raw.items()}, indent=1))
    body = table(rows, tasks)
    print(body)
    if args.write:
        write_section(args.write, body)
        log(f"table written into {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
