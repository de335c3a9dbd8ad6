"""The OpenAI-compatible server (python -m serve.api) at p = 2 on loopback, driven by the official `openai` client.

Oracle: `LLM.generate` on the same checkpoint with the same seeds and settings (float64), itself checked against
transformers in test_llm.py; every step's collectives are checked against the traffic model inside the server's
engine (check_ledger), so a step that moved other bytes would fail the request. The engine thread's queue
timeout, drain and failure paths are also run against a scripted stand-in for LLM (no processes)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch
import transformers
from prometheus_client.parser import text_string_to_metric_families

from serve.api.async_engine import AsyncEngine
from serve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from serve.sampling_params import FieldError, SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-gpt2"
PROMPTS = ["the quick brown", "café ü", "tensor parallel serving is"]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown"}]
CHAT_TEXT = "system: be brief\nuser: the quick brown\nassistant:"  # the plain template, written out by hand
LIVE_TOKENS = 48  # each live stream's tokens: long enough that the next clients arrive while it runs
LIVE = [f"{w} {i}" for i, w in enumerate(["the quick", "tensor", "café", "numbers", "emoji", "serving",
                                          "the lazy", "parallel"] * 2)]
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=7)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """python -m serve.toy_model's GPT-2 (random weights, a BPE trained on the bundled text): the server serves what
    a new user makes offline."""
    from serve.toy_model import write

    path = tmp_path_factory.mktemp("api") / "gpt2"
    write(path, "gpt2", "tiny", seed=1)
    return path


@pytest.fixture(scope="module")
def reference(checkpoint, servers):
    """Every request the server tests send, through LLM.generate (the offline run)."""
    from serve import LLM

    with LLM(str(checkpoint), tensor_parallel_size=2, dtype="float64") as llm:
        chat_ids = llm.tokenizer(CHAT_TEXT, add_special_tokens=False)["input_ids"]
        greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, logprobs=1))
        # a stop string: two clean characters from the middle of a greedy text (random weights make partial bytes)
        full = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0].outputs[0].text
        needle = next(full[i:i + 2] for i in range(len(full) // 2, len(full) - 1)
                      if "\ufffd" not in full[i:i + 2] and full[i:i + 2].strip())
        return {
            "greedy": greedy,
            "stop": (needle, llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                                     stop=[needle]))[0].outputs[0], full),
            "sampled": llm.generate(PROMPTS[2], SamplingParams(max_tokens=12, ignore_eos=True, **SAMPLED))[0],
            "chat": llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0],
            "live": llm.generate(LIVE, [SamplingParams(max_tokens=LIVE_TOKENS, temperature=1.0, seed=100 + i,
                                                       ignore_eos=True) for i in range(len(LIVE))]),
            "chat_ids": chat_ids,
        }


class Server:
    """python -m serve.api in a subprocess, on a free port; its output drained in the background."""

    def __init__(self, checkpoint, *flags, p: int = 2):
        """Starts it; ready() waits for it (the module starts its servers early, while the reference runs)."""
        self.log = Path(str(checkpoint) + f"-{time.monotonic_ns()}.jsonl")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "serve.api", "--model", str(checkpoint), "--tensor-parallel-size", str(p),
             "--port", "0", "--dtype", "float64", "--served-model-name", MODEL, "--iteration-log", str(self.log),
             *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
            start_new_session=True)  # its own group, as a terminal's foreground job: Ctrl-C is SIGINT to the group
        self.started = time.monotonic()
        self.lines: list[str] = []
        self.url = None

    def ready(self, timeout=180) -> "Server":
        if self.url is not None:
            return self
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("serving "):
                break
            assert time.monotonic() < deadline, "".join(self.lines)
        else:
            raise AssertionError(f"the server exited ({self.proc.wait()}): {''.join(self.lines)}")
        self.printed = time.monotonic() - self.started  # "ready in X s" can say no more than this
        self.url = line.split(" on ", 1)[1].split()[0]  # http://127.0.0.1:PORT/v1
        self.ranks = [int(p) for p in subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True,
                                                     text=True).stdout.split()]
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        self.client = openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=60)
        return self

    def post(self, path: str, body) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            text = e.read()
            try:
                return e.code, json.loads(text)
            except json.JSONDecodeError:
                raise AssertionError(f"{e.code} {text!r} is not JSON") from None

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url.removesuffix("/v1") + "/metrics", timeout=10) as r:
            text = r.read().decode()
        return {(s.name + ("" if not s.labels else str(sorted(s.labels.items())))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def steps(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").is_file() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


@pytest.fixture(scope="module")
def servers(checkpoint):
    """The module's servers, started at once: the shared one (ended by two Ctrl-C during two streams), the one whose
    rank a test kills (with a draft model, whose refusals a test checks first), and one that only starts and
    stops."""
    draft = json.dumps({"method": "draft_model", "model": str(checkpoint), "num_speculative_tokens": 2,
                        "draft_acceptance": "rejection_sampler"})
    started = {"shared": Server(checkpoint, "--shutdown-timeout", "20"),
               "doomed": Server(checkpoint, "--speculative-config", draft), "idle": Server(checkpoint, p=1)}
    yield started
    for s in started.values():
        s.stop()


@pytest.fixture(scope="module")
def server(servers, reference):
    return servers["shared"].ready()


def test_the_openai_client_gets_what_generate_gives(server, reference):
    c = server.client
    assert [m.id for m in c.models.list().data] == [MODEL]
    # completions: a batch of prompts, greedy, with logprobs (the chosen tokens' logprobs identify the tokens)
    got = c.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=10, temperature=0, logprobs=1,
                               extra_body={"return_token_ids": True})
    for choice, want in zip(sorted(got.choices, key=lambda ch: ch.index), reference["greedy"]):
        w = want.outputs[0]
        assert choice.token_ids == w.token_ids  # vLLM's return_token_ids
        assert choice.text == w.text and choice.finish_reason == w.finish_reason
        assert len(choice.logprobs.token_logprobs) == len(w.token_ids)
        for lp, t, step in zip(choice.logprobs.token_logprobs, w.token_ids, w.logprobs):
            assert abs(lp - step[t]) < 1e-9
    assert got.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in reference["greedy"])
    assert got.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in reference["greedy"])
    # streamed and sampled with a seed: the pieces add up to generate's text
    want = reference["sampled"].outputs[0]
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, stream=True,
                                       extra_body={"ignore_eos": True, "return_token_ids": True},
                                       stream_options={"include_usage": True}, **SAMPLED))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.text
    assert sum((ch.choices[0].token_ids for ch in chunks if ch.choices), []) == want.token_ids
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert len([ch for ch in chunks if ch.choices]) >= 3  # pieces as they were made, not one at the end
    # a stop string, streamed: what was sent is never taken back, and it ends where generate's text ends
    needle, want, full = reference["stop"]
    parts = list(c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=[needle],
                                      stream=True, extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].text for p in parts) == want.text == full[:full.index(needle)]
    assert parts[-1].choices[0].finish_reason == "stop" == want.finish_reason
    # chat, whole and streamed, against LLM.chat: the plain template (this tokenizer has none), written out by hand
    assert reference["chat"].prompt_token_ids == reference["chat_ids"]
    want = reference["chat"].outputs[0]
    full = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].message.content == want.text and full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens == len(reference["chat_ids"]) and full.usage.completion_tokens == 8
    parts = list(c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == want.text
    assert parts[-1].choices[0].finish_reason == "length"


def stream_text(client, i: int, out: dict, started: list) -> None:
    """Client i sends once client i − 1 has its first token (so each arrives while others run, at any speed)."""
    if i:
        started[i - 1].wait(60)
    stream = client.completions.create(model=MODEL, prompt=LIVE[i], max_tokens=LIVE_TOKENS, temperature=1.0,
                                       seed=100 + i, stream=True, extra_body={"ignore_eos": True})  # vLLM's extra
    texts, rid = [], None
    for chunk in stream:
        rid = chunk.id
        texts.append(chunk.choices[0].text)
        started[i].set()
    out[i] = (rid + "-0", "".join(texts))


def test_live_clients_join_the_running_batch_and_get_the_offline_tokens(server, reference):
    out: dict = {}
    started = [threading.Event() for _ in LIVE]
    threads = [threading.Thread(target=stream_text, args=(server.client, i, out, started)) for i in range(len(LIVE))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(out) == list(range(len(LIVE)))
    for i, want in enumerate(reference["live"]):
        assert out[i][1] == want.outputs[0].text, i
    steps = server.steps()
    first = {rid: s["step"] for s in steps for rid in s["first"]}
    end = {rid: s["step"] for s in steps for rid in s["finished"]}
    ids = [rid for rid, _ in out.values()]
    # a request joined a running batch: its first token came while another one was between its first and last
    joined = [r for r in ids if any(first[q] < first[r] < end[q] for q in ids if q != r)]
    assert len(joined) >= len(ids) // 2, (joined, first, end)
    assert max(s["running"] for s in steps) >= 4


def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_client_that_disconnects_is_aborted_at_the_next_step(server):
    total = server.metrics()["tpref:kv_blocks_free"]
    stream = server.client.completions.create(model=MODEL, prompt="the quick brown", max_tokens=100,
                                              stream=True, extra_body={"ignore_eos": True})
    rid = None
    for n, chunk in enumerate(stream):
        rid = chunk.id + "-0"
        if n == 2:
            break
    stream.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["tpref:kv_blocks_free"] == total and m["tpref:num_requests_running"] == 0:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"blocks not freed: {m}")
    steps = server.steps()
    at = next(i for i, s in enumerate(steps) if rid in s["aborted"])
    # the step that carried the abort freed its blocks; it got no token from then on
    assert steps[at]["free_blocks"] == total and steps[at]["running"] == 0
    assert not any(rid in s["tokens"] for s in steps[at:])
    assert sum(s["tokens"].get(rid, 0) for s in steps) < 100
    # a client waiting for a whole answer that goes away mid-generation: aborted too (checked for every POLL_S)
    aborts = server.metrics().get("tpref:request_success_total[('finished_reason', 'abort')]", 0)
    host, port = server.url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port))) as conn:
        body = json.dumps({"model": MODEL, "prompt": "the quick brown", "max_tokens": 480, "ignore_eos": True})
        conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        wait_until(lambda: server.metrics()["tpref:num_requests_running"] == 1)
    gone_at = time.monotonic()
    wait_until(lambda: server.metrics()["tpref:kv_blocks_free"] == total)
    m = server.metrics()
    assert m["tpref:request_success_total[('finished_reason', 'abort')]"] == aborts + 1
    assert time.monotonic() - gone_at < 1.5  # 480 tokens would take several seconds


BAD = [
    (b"{not json", None, "invalid_json"),
    ([1, 2], None, None),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, "max_tokens", None),
    ({"model": MODEL, "prompt": 5}, "prompt", None),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, "temperature", None),
    ({"model": MODEL, "prompt": "the " * 530, "max_tokens": 4}, "prompt", None),  # longer than the context
    ({"model": MODEL, "prompt": "hi", "max_tokens": 600}, "max_tokens", None),  # cannot fit in 512 positions
    ({"model": "gpt-4o", "prompt": "hi"}, "model", "model_not_found"),
    ({"model": MODEL, "prompt": "hi", "n": 2}, "n", None),
    ({"model": MODEL, "prompt": "hi", "stop": [1]}, "stop", None),
    ({"model": MODEL, "prompt": "hi", "echo": True, "stream": True}, "echo", None),  # vLLM's rule
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens", None),  # 0 only with echo
]
BAD_CHAT = [
    ({"model": MODEL, "messages": []}, "messages", None),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 600},
     "max_completion_tokens", None),  # the field the request gave, not SamplingParams' max_tokens
]


def test_bad_requests_get_400_with_openais_error_and_the_server_goes_on(server):
    for path, cases in (("/completions", BAD), ("/chat/completions", BAD_CHAT)):
        for body, param, code in cases:
            status, answer = server.post(path, body)
            assert status == 400, (body, answer)
            err = answer["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
            assert err["param"] == param and err["code"] == code and err["message"], (body, err)
    for path in ("/v1/nothere", "/v1/completions"):  # unknown path, wrong method: OpenAI's shape too
        try:
            urllib.request.urlopen(server.url.removesuffix("/v1") + path, timeout=10)
        except urllib.error.HTTPError as e:
            assert e.code in (404, 405) and set(json.loads(e.read())["error"]) == {"message", "type", "param", "code"}
        else:
            raise AssertionError(f"GET {path} answered 200")
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        server.client.completions.create(model="gpt-4o", prompt="hi")
    ok = server.client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens >= 1 and ok.choices[0].finish_reason in ("length", "stop")


def test_echo_scores_the_prompt_as_lm_eval_asks(server, checkpoint):
    """lm-eval's log-likelihood request (local-completions): token ids, echo, logprobs 1, max_tokens 1 or 0. Each
    prompt token's logprob (null for the first) and top-1 equal transformers' log_softmax on the same checkpoint
    (float64); the text is the prompt's, then the completion's (none for max_tokens 0, finish_reason "length")."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).eval()
    text = server.client.completions.create(model=MODEL, prompt="the cat sat", max_tokens=2, echo=True)
    assert text.choices[0].text.startswith("the cat sat") and text.choices[0].logprobs is None  # the prompt's own text
    prompts = [[5, 17, 9, 30, 2, 44, 8], [11, 3]]
    for most in (1, 0):
        status, answer = server.post("/completions", {"model": MODEL, "prompt": prompts, "max_tokens": most,
                                                      "logprobs": 1, "echo": True, "temperature": 0})
        assert status == 200, answer
        assert answer["usage"]["completion_tokens"] == most * len(prompts)
        for ids_, choice in zip(prompts, answer["choices"]):
            lp = choice["logprobs"]
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([ids_])).logits[0], -1)
            assert len(lp["tokens"]) == len(ids_) + most and lp["token_logprobs"][0] is None
            assert lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
            for i in range(1, len(ids_)):
                assert abs(lp["token_logprobs"][i] - ref[i - 1, ids_[i]].item()) < 1e-9, (most, i)
                (best, value), = lp["top_logprobs"][i].items()
                assert abs(value - ref[i - 1].max().item()) < 1e-9, (most, i)
            assert choice["text"].startswith("".join(lp["tokens"][:len(ids_)]))
            assert choice["finish_reason"] == "length" and (most or choice["text"] == "".join(lp["tokens"]))


def test_metrics_count_what_was_served(server):
    before = server.metrics()
    long = "the quick brown fox jumps over the lazy dog " * 3  # shares its first blocks with the second request
    a = server.client.completions.create(model=MODEL, prompt=long, max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True})
    b = server.client.completions.create(model=MODEL, prompt=long + "again", max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True})
    after = server.metrics()

    def delta(name):
        return after[name] - before.get(name, 0.0)

    assert delta("tpref:generation_tokens_total") == 10
    assert delta("tpref:prompt_tokens_total") == a.usage.prompt_tokens + b.usage.prompt_tokens
    assert delta("tpref:request_success_total[('finished_reason', 'length')]") == 2
    assert delta("tpref:time_to_first_token_seconds_count") == 2
    assert delta("tpref:time_per_output_token_seconds_count") == 2
    assert delta("tpref:prefix_cache_hits_total") >= 16  # at least one block of 16 found cached
    assert delta("tpref:prefix_cache_queries_total") == a.usage.prompt_tokens + b.usage.prompt_tokens
    assert delta("tpref:collective_bytes_per_rank_total") > 0 and delta("tpref:engine_steps_total") >= 10
    assert after["tpref:kv_blocks_used"] == 0 and after["tpref:num_requests_waiting"] == 0
    assert 0 < after["tpref:prefix_cache_hit_rate"] <= 1 and after["tpref:generation_tokens_per_second"] > 0


def cpu_ticks(pids: list[int]) -> int:
    return sum(sum(int(v) for v in Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[11:13])
               for p in pids)


def test_an_idle_server_sleeps(server):
    time.sleep(0.5)
    pids = [server.proc.pid] + server.ranks
    start, t0 = cpu_ticks(pids), time.monotonic()
    time.sleep(2.0)
    used = (cpu_ticks(pids) - start) / os.sysconf("SC_CLK_TCK") / (time.monotonic() - t0)
    assert used < 0.15, f"an idle server used {used:.0%} of a core"  # measured: about 2%


def test_ctrl_c_drains_and_a_second_ctrl_c_stops_at_once_leaving_nothing(server):
    """Last on the shared server: Ctrl-C in its terminal (SIGINT to its process group; the ranks are in their own,
    so it reaches the server alone, which drains as on SIGTERM) says so, refuses new work with 503, and the two
    in-flight streams go on (the grace period, 20 s here, is longer than they need). A second Ctrl-C stops now:
    both streams end with "abort" and [DONE] within a step, the server exits 0 at once and says so (measured: the
    streams ended 0.01 s and the process 0.16 s after the second signal; before, they ran on to "length" and the
    process exited 7.7 s after), with no traceback, and its ranks are gone."""
    results: dict = {}
    ended: dict = {}
    streaming = [threading.Event() for _ in range(2)]

    def read(i):  # 480 tokens: far longer than the grace period at any speed this suite runs at
        req = urllib.request.Request(server.url + "/completions", json.dumps(
            {"model": MODEL, "prompt": LIVE[i], "max_tokens": 480, "ignore_eos": True, "stream": True}).encode(),
            {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            results[i] = []
            for line in r:
                if line.strip():
                    results[i].append(line.decode().strip())
                    streaming[i].set()
        ended[i] = time.monotonic()

    threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    assert all(e.wait(30) for e in streaming)  # both in flight, their first tokens sent
    os.killpg(server.proc.pid, signal.SIGINT)
    time.sleep(0.3)  # draining: still listening, new work refused with OpenAI's 503
    health = urllib.request.Request(server.url.removesuffix("/v1") + "/health")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(health, timeout=5)
    assert refused.value.code == 503 and json.loads(refused.value.read())["error"]["code"] == "shutting_down"
    assert server.post("/completions", {"model": MODEL, "prompt": "hi"})[0] == 503
    sent = [len(results[i]) for i in range(2)]
    wait_until(lambda: all(len(results[i]) > sent[i] for i in range(2)))  # both streams go on while draining
    assert not ended
    t0 = time.monotonic()
    os.killpg(server.proc.pid, signal.SIGINT)
    assert server.proc.wait(timeout=20) == 0, "".join(server.lines)
    took = time.monotonic() - t0
    for t in threads:
        t.join(10)
    # at once: well inside the 20 s grace period the first Ctrl-C began (idle: 0.16 s; 3.5 s seen on a loaded machine)
    assert took < 6.0 and max(ended.values()) - t0 < 2.0, (took, [e - t0 for e in ended.values()])
    wait_until(lambda: any(line.startswith("stopped ") for line in server.lines), 5)
    said = "".join(server.lines)
    assert "Traceback" not in said and "KeyboardInterrupt" not in said
    assert "shutting down: draining 2 requests for up to 20 s (Ctrl-C again to stop now)\n" in said, said
    assert "stopping now: aborting 2 requests\n" in said and "s after the second (requests: 2 aborted)\n" in said, said
    for i in range(2):
        lines = results[i]
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "abort", last
        assert len(lines) < 400  # far from its 480 tokens
    deadline = time.monotonic() + 5
    while not all(gone(p) for p in server.ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(p) for p in server.ranks)


def test_an_idle_server_says_its_start_up_from_process_start_and_exits_at_once(servers):
    """"ready in X s" counts from the process's start (imports included, a second or more). A chat request without
    max_tokens is given the rest of the context. Ctrl-C
    (SIGINT to its group) with nothing in flight: exit 0 in well under a second (measured about 0.25 s; the
    bound below leaves room for a loaded machine), a line for the signal and one for the exit, its ranks gone."""
    s = servers["idle"].ready()
    printed = float(s.lines[-1].split("ready in ", 1)[1].split(" s")[0])
    ranks = float(s.lines[-1].split("the ranks' start ", 1)[1].split(" s")[0])
    # no more than its parent has waited so far, and more than the ranks' start: the imports before them count
    assert ranks + 0.5 < printed <= s.printed + 0.1, (printed, s.printed, ranks)
    # a chat request without max_tokens gets the rest: prompt + output = max_model_len, here the model's context,
    # vLLM's rule
    code, body = s.post("/chat/completions", {"model": MODEL, "messages": CHAT, "ignore_eos": True})
    assert code == 200 and body["choices"][0]["finish_reason"] == "length", body
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == 512
    with urllib.request.urlopen(s.url + "/models", timeout=10) as r:
        assert json.loads(r.read())["data"][0]["max_model_len"] == 512
    time.sleep(0.5)
    t0 = time.monotonic()
    os.killpg(s.proc.pid, signal.SIGINT)
    assert s.proc.wait(timeout=20) == 0, "".join(s.lines)
    took = time.monotonic() - t0
    assert took < 1.5, took
    wait_until(lambda: any(line.startswith("stopped ") for line in s.lines), 5)
    said = "".join(s.lines)
    assert "shutting down: no request in flight\n" in said and "s after SIGINT\n" in said, said
    time.sleep(0.2)
    assert all(gone(p) for p in s.ranks)


def test_a_field_the_draft_model_cannot_serve_is_named_in_the_400(servers):
    """logprobs under a draft's rejection sampler are not built (serve/spec_decode.check_request): the 400 names
    `logprobs` (the field refused, not the prompt) on both endpoints, and the server goes on serving."""
    s = servers["doomed"].ready()
    for path, body in (("/completions", {"model": MODEL, "prompt": "hi", "logprobs": 2}),
                       ("/chat/completions", {"model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": 2})):
        status, answer = s.post(path, body)
        assert status == 400 and answer["error"]["param"] == "logprobs", answer
        assert "rejection_sampler" in answer["error"]["message"], answer
    status, answer = s.post("/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3})
    assert status == 200 and answer["usage"]["completion_tokens"] >= 1, answer
    by_k = {name: v for name, v in s.metrics().items() if name.startswith("tpref:spec_decode_steps_by_num_proposals")}
    assert len(by_k) == 3 and sum(by_k.values()) >= 1, by_k  # the Tuner's choices, k = 0..2


def test_a_killed_rank_fails_requests_and_the_server_exits_nonzero(servers):
    s = servers["doomed"].ready()
    try:
        events: list = []
        streaming = threading.Event()

        def read():
            req = urllib.request.Request(s.url + "/completions", json.dumps(
                {"model": MODEL, "prompt": "the", "max_tokens": 480, "ignore_eos": True, "stream": True}).encode(),
                {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                for line in r:
                    if line.strip():
                        events.append(line.decode().strip())
                        streaming.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert streaming.wait(30)  # in flight: its first token sent
        t0 = time.monotonic()
        os.kill(s.ranks[1], signal.SIGKILL)
        while True:  # /health looks at the rank processes itself: 503 as soon as the kill has taken effect
            try:
                urllib.request.urlopen(s.url.removesuffix("/v1") + "/health", timeout=5)
            except urllib.error.HTTPError as e:
                health = json.loads(e.read())["error"]
                break
            assert time.monotonic() - t0 < 5
        assert "rank 1 exited" in health["message"] and health["code"] == "engine_failed", health
        statuses = []
        while s.proc.poll() is None and time.monotonic() - t0 < 10:  # new requests: 503 until it stops listening
            try:
                statuses.append(s.post("/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})[0])
            except OSError:
                break
            time.sleep(0.05)
        code = s.proc.wait(timeout=10)
        took = time.monotonic() - t0
        reader.join(10)
        assert code == 1 and took < 10, (code, took)
        assert 503 in statuses and statuses[statuses.index(503):] == [503] * (len(statuses) - statuses.index(503))
        error = json.loads(events[-1].removeprefix("data: "))["error"]
        assert "rank 1 exited" in error["message"] and error["code"] == "engine_failed", error
        assert "rank 1 exited" in "".join(s.lines)
        with pytest.raises(OSError):  # nothing listens any more
            urllib.request.urlopen(s.url + "/models", timeout=5)
        time.sleep(0.5)
        assert all(gone(p) for p in s.ranks)
    finally:
        s.stop()


def test_bad_command_lines_fail_fast_before_any_rank_starts(checkpoint):
    """Each a one-line error and exit 2, in a second or two: no rank is started for a command that cannot serve."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    for flags, message in ((["--model", "llama_tiny"], "not a directory"),
                           (["--model", str(checkpoint), "--tokenizer", str(checkpoint.parent)], "no tokenizer files"),
                           (["--model", str(checkpoint), "--max-num-seqs", "0"], "--max-num-seqs=0"),
                           (["--model", str(checkpoint), "--queue-timeout", "0"], "--queue-timeout"),
                           (["--model", str(checkpoint), "--port", str(port)], f"cannot listen on 127.0.0.1:{port}")):
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "serve.api", *flags], capture_output=True, text=True, cwd=ROOT,
                              timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, (flags, proc.stderr)
        assert proc.stderr.count("\n") == 1 and time.monotonic() - start < 15
    taken.close()


# ---- the engine thread against a scripted LLM (no processes) ------------------------------------------------------


class ScriptedLLM:
    """LLM's online calls: each live request gets one token per step (none while `hold` is set); step raises once
    `fail` is set."""

    def __init__(self):
        self.live: dict[str, RequestOutput] = {}
        self.aborted: list[str] = []
        self.hold = False
        self.fail = False
        self.closed = False
        self.exited: list[tuple[int, int]] = []  # (rank, code) of the rank processes that have exited
        self.scheduling_policy = "fcfs"
        self.priorities: dict[str, int] = {}  # each request's priority as add_request received it
        self.executor = type("Executor", (), {"exited": lambda _: self.exited})()
        self.last_stats = self.stats()

    def stats(self):
        return {"running": len(self.live), "waiting": 0, "free_blocks": 8, "num_blocks": 8}

    def add_request(self, rid, prompt, params, wait=True, priority=0):
        from serve.scheduler import check_priority

        check_priority(priority, self.scheduling_policy)  # LLM's rule
        self.priorities[rid] = priority
        if len(prompt["prompt_token_ids"]) > 4:
            raise FieldError("prompt holds 5, not a token id of the vocabulary [0, 4)", "prompt")  # as LLM's checks
        if 0 in prompt["prompt_token_ids"]:
            raise ValueError("refused, for no field in particular")
        self.live[rid] = RequestOutput(rid, None, prompt["prompt_token_ids"], [CompletionOutput(0, "", [])], False,
                                       RequestMetrics(time.time()))
        self.live[rid].max_tokens = params.max_tokens

    def serve(self):
        self.serving = True

    def serve_outputs(self, timeout):
        assert self.serving, "serve_outputs before serve()"
        if self.live and (self.fail or not self.hold):
            return self.step()
        time.sleep(min(timeout, 0.01))
        return None

    def detokenize(self, outputs):
        return outputs

    def step(self):
        time.sleep(0.002)  # a step takes time
        if self.fail:
            raise RuntimeError("step: rank 1 exited (code -9) without a Python error\ntraceback ...")
        out = []
        for rid, o in list(self.live.items()):
            if self.hold:
                continue
            c = o.outputs[0]
            c.token_ids = c.token_ids + [7]
            c.text += "x"
            if len(c.token_ids) == o.max_tokens:
                o.finished, c.finish_reason = True, "length"
                del self.live[rid]
            out.append(RequestOutput(rid, None, o.prompt_token_ids, [CompletionOutput(0, c.text, list(c.token_ids),
                                     c.finish_reason)], o.finished))
        self.last_stats = self.stats()
        return out

    def abort_request(self, rid, wait=True):
        self.aborted.append(rid)
        return self.live.pop(rid, None) is not None

    def has_unfinished_requests(self):
        return bool(self.live)

    def check_health(self):
        pass

    def shutdown(self):
        self.closed = True


def collect(engine, rid, prompt, max_tokens=3):
    events: list = []
    engine.submit(rid, prompt, None, SamplingParams(temperature=0.0, max_tokens=max_tokens), events.append)
    return events


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_the_engine_thread_refuses_times_out_drains_and_fails_cleanly():
    llm = ScriptedLLM()
    failures = []
    engine = AsyncEngine(llm, queue_timeout_s=0.3, on_failure=lambda: failures.append(1))
    engine.start()
    ok = collect(engine, "ok", [1, 2], max_tokens=3)
    bad = collect(engine, "bad", [1, 2, 3, 4, 5])
    wait_for(lambda: ok and ok[-1][0] == "output" and ok[-1][1].finished)
    assert [e[1].outputs[0].text for e in ok] == ["x", "xx", "xxx"]
    assert bad[0][0] == "error" and bad[0][1].status == 400 and bad[0][1].param == "prompt"
    unnamed = collect(engine, "unnamed", [0])  # an error that names no field is not pinned on one
    wait_for(lambda: unnamed)
    assert unnamed[0][0] == "error" and unnamed[0][1].status == 400 and unnamed[0][1].param is None
    # a request that gets no token within the queue timeout: aborted in the engine, answered 503
    llm.hold = True
    stuck = collect(engine, "stuck", [1])
    wait_for(lambda: stuck)
    assert stuck[0][0] == "error" and stuck[0][1].status == 503 and stuck[0][1].code == "queue_timeout"
    assert "stuck" in llm.aborted
    # a client gone: aborted, nothing more sent
    llm.hold = False
    gone_events = collect(engine, "gone", [1], max_tokens=10 ** 6)
    wait_for(lambda: gone_events)
    engine.abort("gone")
    wait_for(lambda: "gone" in llm.aborted)
    n = len(gone_events)
    time.sleep(0.1)
    assert len(gone_events) == n
    # a rank fails: every live request hears it once, on_failure runs, new requests are refused, ranks stopped
    live = collect(engine, "live", [1], max_tokens=500)
    wait_for(lambda: live)
    assert engine.exited_rank() is None
    llm.exited = [(1, -9)]  # /health says so at once, before the engine thread's next look at the ranks
    assert engine.exited_rank() == "rank 1 exited (code -9)" and engine.failed is None
    llm.fail = True
    wait_for(lambda: live[-1][0] == "error")
    assert live[-1][1].status == 503 and "rank 1 exited" in live[-1][1].message
    assert "\n" not in engine.failed and "traceback" in engine.detail
    assert failures == [1] and engine.done.wait(5) and llm.closed
    with pytest.raises(Exception, match="failed"):
        engine.submit("late", [1], None, SamplingParams(temperature=0.0), print)


def test_draining_lets_requests_finish_then_aborts_the_rest():
    llm = ScriptedLLM()
    engine = AsyncEngine(llm, queue_timeout_s=60)
    engine.start()
    short = collect(engine, "short", [1], max_tokens=2)
    long = collect(engine, "long", [1], max_tokens=10 ** 6)
    wait_for(lambda: short and short[-1][1].finished)
    engine.drain(0.3)
    assert engine.done.wait(5) and llm.closed
    assert long[-1] == ("abort", None) and "long" in llm.aborted
    with pytest.raises(Exception, match="shutting down"):
        engine.submit("late", [1], None, SamplingParams(temperature=0.0), print)


def test_the_priority_field_reaches_the_engine():
    """vLLM's extra field `priority` on completions and chat requests is the priority LLM.add_request receives (one
    per prompt of a request); with scheduling_policy fcfs a priority other than 0 is a 400 naming it."""
    from starlette.testclient import TestClient

    from serve.api.app import build_app
    from serve.api.metrics import ServerMetrics

    class Tokenizer:  # a tokenizer of one id per request text: the prompt fits the scripted LLM's check
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [1]}

    llm = ScriptedLLM()
    llm.scheduling_policy = "priority"
    engine = AsyncEngine(llm, queue_timeout_s=60)
    engine.start()
    app = build_app(engine, model_name="m", tokenizer=Tokenizer(), max_model_len=16, max_positions=16,
                    metrics=ServerMetrics())
    ask = dict(model="m", max_tokens=2, temperature=0.0)
    with TestClient(app) as client:
        done = client.post("/v1/completions", json=dict(ask, prompt=[[1], [2, 3]], priority=-5))
        chat = client.post("/v1/chat/completions", json=dict(ask, messages=[{"role": "user", "content": "hi"}],
                                                               priority=7))
        plain = client.post("/v1/completions", json=dict(ask, prompt=[1]))
        assert (done.status_code, chat.status_code, plain.status_code) == (200, 200, 200), done.text + chat.text
        assert sorted(llm.priorities.values()) == [-5, -5, 0, 7]
        assert [v for k, v in llm.priorities.items() if k.startswith("chatcmpl-")] == [7]
        llm.scheduling_policy = "fcfs"
        refused = client.post("/v1/completions", json=dict(ask, prompt=[1], priority=1))
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
        assert "needs scheduling_policy='priority'" in refused.json()["error"]["message"]
        bad = client.post("/v1/completions", json=dict(ask, prompt=[1], priority="high"))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
    engine.drain(0)
    assert engine.done.wait(5)
