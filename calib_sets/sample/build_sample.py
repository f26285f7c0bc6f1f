"""Rebuild the shipped sample production log, calib_sets/sample/requests.jsonl.gz.

    .venv/bin/python calib_sets/sample/build_sample.py [--requests 2500] [--out PATH] [--seed 0]

It starts the project's own server (`quantpipe serve`, default model, on 127.0.0.1 only)
with `--request-log`, replays a planned mix of conversations against it with 16 in
flight, stops it with SIGTERM (which drains and flushes the log), and gzips the log.
So every line is what the real runtime logs, including its own refusals.

Prompts come only from text every machine has offline: Python's documentation topics
(pydoc_data), the standard library's own source, and a few BIG-bench task files from
its PyPI sdist (fetched with pip unless --bigbench names a copy). The plan (tasks,
turns, prompts, parameters, labels) is a pure function of --seed and the Python
version; the model's replies, and so later turns' contexts, may differ run to run.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import glob
import gzip
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pydoc_data.topics import topics as PYDOC

import httpx

# Share of *requests* per task; deliberately skewed (one dominant task, one rare one)
# so that a sampler that stratifies by metadata.task has something to fix.
SHARES = {"docs_qa": .42, "summarize": .12, "code_explain": .11, "classify": .10, "code_complete": .09,
          "multiple_choice": .09, "chitchat": .045, "translate": .025}
# Probability of 1, 2, 3, 4 turns per conversation; code_complete is a one-shot completion.
TURNS = {"docs_qa": [.40, .30, .18, .12], "summarize": [.6, .3, .1], "code_explain": [.5, .3, .15, .05],
         "classify": [.8, .2], "code_complete": [1], "multiple_choice": [.75, .25],
         "chitchat": [.2, .3, .3, .2], "translate": [.7, .3]}
# Short outputs keep a 2,500-request run within about half an hour on two CPU cores.
MAX_TOKENS = {"docs_qa": (32, 48, 64), "summarize": (32, 48), "code_explain": (32, 48), "classify": (24,),
              "code_complete": (24, 32, 48), "multiple_choice": (24, 32), "chitchat": (24, 32), "translate": (32, 48)}
TENANTS = {"helpdesk": .68, "ide-plugin": .24, "edu-lab": .08}    # the second, skewed label
CODE_TENANTS = {"ide-plugin": .8, "helpdesk": .15, "edu-lab": .05}  # code traffic comes from the editor
SYSTEM = {"helpdesk": "You are a concise assistant for Python developers. Answer in a few sentences.",
          "ide-plugin": "You are a coding assistant inside a code editor. Be brief and precise.",
          "edu-lab": "You are a patient tutor for students learning Python."}
ERROR_SHARE = .01  # requests that fail the way real clients' requests do (bad parameters, a too-long paste)
CONCURRENCY = 16
# --dtype auto: bfloat16 where the CPU has native bf16, else float32 (emulated bf16 is ~6x slower).
SERVE_FLAGS = ["--dtype", "auto", "--max-model-len", "2048", "--kv-cache-memory", "512MiB", "--log-level", "warning"]

BB_CLASSIFY = ["sports_understanding", "irony_identification", "intent_recognition"]
BB_CHOICE = ["date_understanding", "general_knowledge", "logical_deduction/three_objects", "english_proverbs"]
BB_TRANSLATE = ["conlang_translation/*", "international_phonetic_alphabet_transliterate"]
CODE_MODULES = ["textwrap", "shlex", "heapq", "bisect", "fractions", "statistics", "colorsys", "calendar",
                "difflib", "string", "fnmatch", "glob", "posixpath", "base64", "json/decoder", "json/encoder",
                "urllib/parse", "email/utils", "csv", "configparser", "argparse", "functools", "datetime",
                "ipaddress", "random", "shutil", "tokenize", "copy", "pprint", "gettext", "graphlib", "uuid"]


def fail(msg: str) -> None:
    sys.exit(f"build_sample: {msg}")


def pick(rng: random.Random, weights: dict):
    return rng.choices(list(weights), list(weights.values()))[0]


# ---------------------------------------------------------------- offline text sources

def bigbench_tasks(where: str | None) -> dict[str, dict]:
    """{task name: task.json} for the tasks above, from a folder, the sdist tarball, or pip."""
    wanted = BB_CLASSIFY + BB_CHOICE + BB_TRANSLATE
    if where is None:  # the default: a copy cached in the temp folder, fetched once with pip
        where = os.path.join(tempfile.gettempdir(), "quantpipe-bigbench-1.0.0")
        if not os.path.isdir(os.path.join(where, "benchmark_tasks")):
            fetch_bigbench(where)
    if os.path.isfile(where) and tarfile.is_tarfile(where):
        with tarfile.open(where) as tar:
            files = {m.name.split("benchmark_tasks/", 1)[1]: m for m in tar.getmembers()
                     if "/bigbench/benchmark_tasks/" in m.name and m.name.endswith("/task.json")}
            out = {rel[:-len("/task.json")]: json.load(tar.extractfile(files[rel]))
                   for w in wanted for rel in sorted(files) if fnmatch.fnmatch(rel, w + "/task.json")}
        missing = [w for w in wanted if not any(fnmatch.fnmatch(k, w) for k in out)]
        if missing:
            fail(f"--bigbench {where!r}: the tarball lacks the tasks {missing}")
        return out
    roots = [p for p in (os.path.join(where, "benchmark_tasks"), os.path.join(where, "bigbench", "benchmark_tasks"),
                         where) if os.path.isfile(os.path.join(p, BB_CLASSIFY[0], "task.json"))]
    if not roots:
        fail(f"--bigbench {where!r}: no bigbench/benchmark_tasks/*/task.json there "
             "(give the bigbench-1.0.0 sdist tarball or a folder that holds its benchmark_tasks)")
    out = {}
    for w in wanted:
        paths = sorted(glob.glob(os.path.join(roots[0], w, "task.json")))
        if not paths:
            fail(f"BIG-bench task {w!r} is missing under {roots[0]}")
        for p in paths:
            with open(p, encoding="utf-8") as f:
                out[os.path.relpath(os.path.dirname(p), roots[0]).replace(os.sep, "/")] = json.load(f)
    return out


def fetch_bigbench(cache: str) -> None:
    """pip fetches and unpacks the sdist, then refuses it (its setup.py names a file:// dependency);
    --no-clean keeps the unpacked copy, from which only the task files used here are kept."""
    work = tempfile.mkdtemp(prefix="bigbench-")
    print("fetching the bigbench 1.0.0 sdist with pip (it unpacks ~2 GB, briefly) ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "download", "bigbench==1.0.0", "--no-deps", "--no-binary", ":all:",
                    "--no-clean", "-q", "-d", os.path.join(work, "dl")], env={**os.environ, "TMPDIR": work},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    found = glob.glob(os.path.join(work, "dl", "bigbench-*.tar.gz")) or \
        glob.glob(os.path.join(work, "pip-*", "*", "bigbench", "benchmark_tasks"))
    try:
        if not found:
            fail("could not fetch bigbench==1.0.0 with pip; download its sdist elsewhere and pass --bigbench PATH")
        part = cache + f".part{os.getpid()}"  # renamed into place whole, so a killed run leaves no half cache
        for name, task in bigbench_tasks(found[0]).items():
            os.makedirs(os.path.join(part, "benchmark_tasks", name), exist_ok=True)
            with open(os.path.join(part, "benchmark_tasks", name, "task.json"), "w", encoding="utf-8") as f:
                json.dump(task, f)
        shutil.rmtree(cache, ignore_errors=True)
        os.replace(part, cache)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def pydoc_paragraphs() -> dict[str, list[str]]:
    return {k: [p.strip("\n") for p in re.split(r"\n\s*\n", PYDOC[k]) if p.strip()] for k in sorted(PYDOC)}


def stdlib_functions() -> list[dict]:
    """Functions and methods of a few pure-Python stdlib modules, read from their source files."""
    lib, out = os.path.dirname(os.__file__), []
    for mod in CODE_MODULES:
        path = os.path.join(lib, *mod.split("/")) + ".py"
        if not os.path.isfile(path):
            continue  # a module this Python does not have
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        for node in sorted((n for n in ast.walk(ast.parse("\n".join(lines)))
                            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), key=lambda n: n.lineno):
            body = [ln[node.col_offset:] for ln in lines[node.lineno - 1:node.end_lineno]]
            src = "\n".join(body)
            if not 150 <= len(src) <= 4000:
                continue
            doc_end = None  # the line after the docstring: code_complete's cursor
            if ast.get_docstring(node) and node.body[0].end_lineno < node.end_lineno:
                doc_end = node.body[0].end_lineno
            out.append({"module": mod.replace("/", "."), "name": node.name, "lines": body, "doc_end": doc_end,
                        "file": lines, "start": node.lineno - 1})
    return out


# ---------------------------------------------------------------- one conversation's plan

def cut(text: str, limit: int) -> str:
    """At most `limit` characters, cut at a line end when one is near (contexts stay 50-600 tokens)."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    return head[:head.rfind("\n")] if head.rfind("\n") > limit // 2 else head


class Planner:
    def __init__(self, seed: int, bigbench: dict[str, dict]):
        self.rng = random.Random(seed)
        self.docs, self.funcs, self.bb = pydoc_paragraphs(), stdlib_functions(), bigbench
        self.doc_funcs = [f for f in self.funcs if f["doc_end"]]
        if not self.funcs or not self.doc_funcs:
            fail("found no stdlib functions to quote; is the standard library's source installed?")

    def excerpt(self, lo: int, hi: int) -> tuple[str, str]:
        topic = self.rng.choice(list(self.docs))
        paras = self.docs[topic]
        start, budget, out = self.rng.randrange(len(paras)), self.rng.randint(lo, hi), []
        for p in paras[start:]:
            if out and len("\n\n".join(out + [p])) > budget:
                break
            out.append(p)
        return topic, cut("\n\n".join(out), budget)

    def term(self, text: str, topic: str) -> str:
        terms = re.findall(r'"([^"\n]{2,40})"', text)  # pydoc quotes code names like "__debug__"
        return f'"{self.rng.choice(terms)}"' if terms else topic.replace("-", " ")

    def docs_qa(self):
        topic, text = self.excerpt(250, 1800)
        q = self.rng.choice(["What does {t} mean in this context?", "According to the documentation above, how does "
                             "{t} behave?", "Can you explain the part about {t} in simpler words?",
                             "Is there anything I should watch out for with {t}?", "When would I use {t}?",
                             "What is this section about?"]).format(t=self.term(text, topic))
        first = self.rng.choice(["Here is part of the Python documentation on {topic}:\n\n{text}\n\n{q}",
                                 "{text}\n\nQuestion: {q}", 'Context:\n"""\n{text}\n"""\n{q}'])
        follow = ["Can you give a short example?", "Why is it designed that way?",
                  f"And what about {self.term(text, topic)}?",
                  "Thanks. Can you say that in one sentence?", "What error do I get if I get it wrong?",
                  "How is this different in other languages?"]
        return f"pydoc:{topic}", first.format(topic=topic.replace("-", " "), text=text, q=q), follow

    def summarize(self):
        topic, text = self.excerpt(400, 2000)
        first = self.rng.choice(["Summarize the following documentation excerpt in two sentences:\n\n{t}",
                                 "TL;DR this for me:\n{t}", "Write a one-paragraph summary for a beginner:\n\n{t}"])
        return f"pydoc:{topic}", first.format(t=text), ["Shorter, please.", "Now as three bullet points.",
                                                         "What is the single most important point?"]

    def code_explain(self):
        f = self.rng.choice(self.funcs)
        src = cut("\n".join(f["lines"]), self.rng.randint(300, 1600))
        first = self.rng.choice(["Explain what this function from the `{m}` module does:\n\n```python\n{s}\n```",
                                 "What does this code do? Keep it short.\n\n{s}",
                                 "I found this in {m}. Can you walk me through it?\n```\n{s}\n```"])
        names = sorted(set(re.findall(r"\b[a-z_]{4,}\b", src)) - {"self", "return", "none", "else", "elif"})
        follow = ["What happens if the input is empty?", "Could it be written more simply?",
                  "What is its time complexity?"]
        follow += [f"Why does it use `{n}`?" for n in self.rng.sample(names, min(2, len(names)))]
        return f"stdlib:{f['module']}.{f['name']}", first.format(m=f["module"], s=src), follow

    def code_complete(self):
        # An editor sends the file up to the cursor, here just after a docstring: the function
        # itself plus some of the code above it.
        f = self.rng.choice(self.doc_funcs)
        above = "\n".join(f["file"][max(0, f["start"] - 60):f["start"]])
        above = above[len(above) - self.rng.randint(0, 1200):] if above else ""
        prompt = above[above.find("\n") + 1:] + "\n" + "\n".join(f["file"][f["start"]:f["doc_end"]]) + "\n"
        if self.rng.random() < .5:  # some editors also send the file's name as a header comment
            prompt = f"# {f['module'].replace('.', '/')}.py\n" + prompt
        return f"stdlib:{f['module']}.{f['name']}", prompt.lstrip("\n"), []

    def _example(self, patterns: list[str]):
        pattern = self.rng.choice(patterns)  # a task family first, then one of its subtasks
        name = self.rng.choice(sorted(k for k in self.bb if fnmatch.fnmatch(k, pattern)))
        task = self.bb[name]
        return name, task, self.rng.choice(task["examples"])

    def classify(self):
        name, task, ex = self._example(BB_CLASSIFY)
        labels = list(ex["target_scores"])
        shots = ""
        if self.rng.random() < .5:  # few-shot prompts are common in classification traffic
            for s in [s for s in self.rng.sample(task["examples"], 4) if s is not ex][:3]:
                shots += f"{s['input']}\nLabel: {max(s['target_scores'], key=s['target_scores'].get)}\n\n"
        prefix = task.get("task_prefix", "").strip() or "Classify the following."
        msg = f"{prefix}\n\n{shots}{ex['input']}\nAnswer with one of: {', '.join(labels)}."
        return f"bigbench:{name}", msg, ["Why?", "Are you sure?", "Explain your answer in one sentence."]

    def multiple_choice(self):
        name, task, ex = self._example(BB_CHOICE)
        options = list(ex["target_scores"])
        self.rng.shuffle(options)
        listed = "\n".join(f"({chr(65 + i)}) {o}" for i, o in enumerate(options))
        msg = f"{task.get('task_prefix', '').strip()}\n\n{ex['input'].strip()}\nOptions:\n{listed}\n" \
              "Answer with the letter."
        return f"bigbench:{name}", msg.strip(), ["Why is that the right option?", "What about option (B)?"]

    def translate(self):
        name, task, ex = self._example(BB_TRANSLATE)
        prefix = cut(task.get("task_prefix", "").strip(), 1800)
        msg = f"{prefix}\n\n{task.get('example_input_prefix', '').strip()} {ex['input']}\n" \
              f"{task.get('example_output_prefix', '').strip()}"
        return f"bigbench:{name}", msg.strip(), ["Now translate it back.", "Explain the words you used."]

    def chitchat(self):
        topic = self.rng.choice(list(self.docs)).replace("-", " ")
        mod = self.rng.choice(CODE_MODULES).replace("/", ".")
        first = self.rng.choice(["hi! how's it going?", f"hey, quick question: do you like the {mod} module?",
                                 "good morning :) I'm starting to learn Python today. Any tips?",
                                 f"I just spent two hours on a bug with {topic}. ugh.",
                                 f"Tell me a fun fact about Python's {mod} module.", "thanks for the help earlier!",
                                 f"what's harder to learn in Python, {topic} or {mod}?"])
        return "chat", first, ["haha, fair enough", "why do you say that?", "ok, and what else?", "cool, thanks!",
                               f"can you tell me a joke about {topic}?", "what would you do instead?"]

    def conversation(self, i: int, task: str, n_turns: int) -> dict:
        rng = self.rng
        source, first, follow = getattr(self, task)()
        tenant = pick(rng, CODE_TENANTS if task.startswith("code") else TENANTS)
        user = {"helpdesk": f"u-{int(rng.paretovariate(1.2)) % 300}" if rng.random() < .7 else None,
                "ide-plugin": f"dev-{rng.randrange(60)}", "edu-lab": None}[tenant]
        temp = 0.0 if rng.random() < (.8 if task in ("classify", "multiple_choice", "code_complete") else .5) else 0.7
        conv = {"task": task, "endpoint": "/v1/completions" if task == "code_complete" else "/v1/chat/completions",
                "system": SYSTEM[tenant] if task != "code_complete" and rng.random() < .6 else None,
                "turns": [], "stream": task != "code_complete" and rng.random() < .15}
        cid = f"conv-{i:05d}-{rng.getrandbits(24):06x}"
        # Newer OpenAI clients send max_completion_tokens instead of max_tokens (chat only).
        key = "max_completion_tokens" if task != "code_complete" and rng.random() < .2 else "max_tokens"
        top_p = temp and rng.random() < .5
        for t in range(n_turns):
            params = {key: rng.choice(MAX_TOKENS[task]), "temperature": temp}
            if top_p:
                params["top_p"] = 0.9
            if task == "code_complete":
                params["stop"] = ["\ndef ", "\nclass ", "\n\n\n"]
            params["metadata"] = {"task": task, "tenant": tenant, "conversation_id": cid, "turn": str(t + 1),
                                  "source": source}
            if user:
                params["user"] = user
            text = first if t == 0 else follow.pop(rng.randrange(len(follow)))
            conv["turns"].append({"text": text, "params": params})
        return conv

    def plan(self, n_requests: int) -> list[dict]:
        # Pick tasks with weight share / mean turns, so that *request* shares come out as SHARES.
        mean = {t: sum((k + 1) * p for k, p in enumerate(w)) for t, w in TURNS.items()}
        weights = {t: SHARES[t] / mean[t] for t in SHARES}
        convs, total = [], 0
        while total < n_requests:
            task = pick(self.rng, weights)
            n = min(self.rng.choices(range(1, len(TURNS[task]) + 1), TURNS[task])[0], n_requests - total)
            convs.append(self.conversation(len(convs), task, n))
            total += n
        # About 1% of requests are broken the way real clients break them; each is the last
        # turn of its conversation, since a client whose request failed does not go on.
        for conv in self.rng.sample(convs, max(1, round(ERROR_SHARE * n_requests))):
            turn, kind = conv["turns"][-1], self.rng.choice(["max_tokens0", "top_p0", "temperature", "too_long", "ctx"])
            key = "max_completion_tokens" if "max_completion_tokens" in turn["params"] else "max_tokens"
            if kind == "max_tokens0":
                turn["params"][key] = 0
            elif kind == "top_p0":
                turn["params"]["top_p"] = 0.0
            elif kind == "temperature":
                turn["params"]["temperature"] = -1.0
            elif kind == "ctx":  # asks for more tokens than the context holds
                turn["params"][key] = 4096
            else:  # someone pastes a whole chapter: past the 2,048-token context
                big = [k for k in sorted(PYDOC) if len(PYDOC[k]) > 12000]
                turn["text"] = PYDOC[self.rng.choice(big)][:16000] + \
                    ("\n" if conv["task"] == "code_complete" else "\n\nSummarize this.")
        return convs


# ---------------------------------------------------------------- replaying it against the server

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def send(client: httpx.Client, endpoint: str, body: dict) -> str | None:
    """POST one request; the reply's text, or None when the server refused it."""
    if not body.get("stream"):
        r = client.post(endpoint, json=body)
        if r.status_code != 200:
            return None
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]
    parts = []
    with client.stream("POST", endpoint, json=body) as r:
        if r.status_code != 200:
            r.read()
            return None
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:]).get("choices", []):
                    parts.append((c.get("delta") or {}).get("content") or "")
    return "".join(parts)


def run_conversation(client: httpx.Client, model: str, conv: dict, done: Counter, lock: threading.Lock) -> None:
    messages = [{"role": "system", "content": conv["system"]}] if conv["system"] else []
    for turn in conv["turns"]:
        body = {"model": model, **turn["params"]}
        if conv["endpoint"] == "/v1/completions":
            body["prompt"] = turn["text"]
        else:
            messages.append({"role": "user", "content": turn["text"]})
            body["messages"] = list(messages)
            if conv["stream"]:
                body["stream"] = True
        try:
            reply = send(client, conv["endpoint"], body)
        except httpx.HTTPError as e:  # logged by the server as aborted or timeout, if at all
            print(f"request failed: {e!r}", file=sys.stderr)
            reply = None
        with lock:
            done["sent"] += 1
            done["ok" if reply is not None else "refused"] += 1
            if done["sent"] % 100 == 0:
                print(f"  {done['sent']} requests ({done['refused']} refused)", file=sys.stderr)
        if reply is None:
            return  # the next turn would need this reply
        messages.append({"role": "assistant", "content": reply})


def serve_and_replay(convs: list[dict], log_path: str) -> int:
    """Serve, replay the conversations, stop the server; the number of requests sent."""
    port = free_port()
    cmd = [sys.executable, "-m", "quantpipe", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--request-log", log_path, *SERVE_FLAGS]
    server = subprocess.Popen(cmd)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:  # loading the model takes a while on a CPU
            if server.poll() is not None:
                fail(f"the server exited with {server.returncode} before it was ready: {' '.join(cmd)}")
            try:
                if httpx.get(base + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                fail("the server did not become healthy within 10 minutes")
            time.sleep(1)
        model = httpx.get(base + "/v1/models", trust_env=False).json()["data"][0]["id"]
        done, lock = Counter(), threading.Lock()
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        # trust_env=False: no proxy from the environment; this traffic stays on 127.0.0.1.
        client = httpx.Client(base_url=base, timeout=600, limits=limits, trust_env=False)
        with client, ThreadPoolExecutor(CONCURRENCY) as pool:
            for f in [pool.submit(run_conversation, client, model, c, done, lock) for c in convs]:
                f.result()
        print(f"sent {done['sent']} requests, {done['refused']} refused", file=sys.stderr)
        return done["sent"]
    finally:
        server.send_signal(signal.SIGTERM)  # drains in-flight requests and flushes the log
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--requests", type=int, default=2500, help="requests to send (default 2500)")
    ap.add_argument("--out", default=os.path.join(here, "requests.jsonl.gz"), help="gzip JSONL to write")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompt plan (default 0)")
    ap.add_argument("--bigbench", help="bigbench-1.0.0 sdist tarball or unpacked folder (default: fetch with pip)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan as JSON lines; start no server")
    args = ap.parse_args()
    if not 1 <= args.requests <= 100_000:
        ap.error(f"--requests must be between 1 and 100000, got {args.requests}")
    if not args.out.endswith(".jsonl.gz"):
        ap.error(f"--out must end in .jsonl.gz, got {args.out!r}")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        ap.error(f"--out: folder {os.path.dirname(os.path.abspath(args.out))!r} does not exist")

    convs = Planner(args.seed, bigbench_tasks(args.bigbench)).plan(args.requests)
    if args.dry_run:
        for conv in convs:
            print(json.dumps(conv, ensure_ascii=False))
        return
    print(f"planned {len(convs)} conversations, {sum(len(c['turns']) for c in convs)} requests", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "requests.jsonl")
        start = time.time()
        sent = serve_and_replay(convs, log_path)
        print(f"generation took {time.time() - start:.0f} s", file=sys.stderr)
        lines = []
        if os.path.exists(log_path):
            with open(log_path, "rb") as f:
                lines = f.read().splitlines(keepends=True)
        if len(lines) != sent:  # the server logs every request it received, refused ones too
            fail(f"the server logged {len(lines)} of the {sent} requests sent; {args.out} is left as it was")
        part = args.out + ".part"
        with open(part, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz:
            gz.writelines(lines)
        os.replace(part, args.out)
    records = [json.loads(ln) for ln in lines]
    tasks = Counter((r.get("metadata") or {}).get("task") for r in records)
    print(f"wrote {args.out}: {len(records)} lines, {os.path.getsize(args.out) / 1e6:.1f} MB, "
          f"{len({(r.get('metadata') or {}).get('conversation_id') for r in records})} conversations", file=sys.stderr)
    statuses = Counter(r["status"] for r in records).most_common()
    print("status: " + ", ".join(f"{k} {v}" for k, v in statuses), file=sys.stderr)
    for task, n in tasks.most_common():
        print(f"  {task:16} {n:5}  {100 * n / len(records):5.1f}%", file=sys.stderr)


if __name__ == "__main__":
    main()
