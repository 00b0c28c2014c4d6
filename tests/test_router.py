"""The prefix-aware router: its choice (longest leading run of chained block hashes, load balancing past a
threshold, round-robin), then real replicas (``python -m llmsys serve`` processes of the tiny model on
loopback) behind it: a session's turns stay on one replica and hit its prefix cache, as the replicas' own
/metrics count; round-robin spreads them; a replica killed mid-session or mid-answer; a replica hung
(SIGSTOP) mid-answer, and slow answers that must not be taken for hung ones; busy replicas (429); every
replica down (503); bad replica URLs on the command line."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from llmsys.core.dist import free_port
from llmsys.serving.api import BackgroundServer
from llmsys.serving.blocks import prefix_hashes
from llmsys.serving.load import scrape
from llmsys.serving.replica_health import Timeouts
from llmsys.serving.router import RouterThread
from llmsys.serving.routing import NoReplica, Replica, Router

pytestmark = pytest.mark.timeout(240)

TINY = ("--model", "tiny", "--dtype", "fp32", "--context", "1024")
BS = 16


# ----------------------------------------------------------------------------- the choice, no processes

def two(policy="prefix", **kw):
    a, b = Replica("http://a"), Replica("http://b")
    return a, b, Router([a, b], policy, block_size=BS, **kw)


def test_longest_cached_prefix_wins():
    a, b, router = two()
    prompt = list(range(100, 196))  # 6 full blocks
    a.remember(prefix_hashes(prompt[:32], BS))
    b.remember(prefix_hashes(prompt[:80], BS))
    choice = router.choose(prompt, router.hashes(prompt))
    assert (choice.replica, choice.reason, choice.matched_tokens) == (b, "prefix", 80)


def test_a_block_ending_at_the_prompt_last_token_is_no_hit():
    """The replica computes the last token whatever it holds (BlockManager.add), so the router expects
    one block fewer for a prompt of exactly two blocks that the replica holds whole."""
    a, b, router = two()
    prompt = list(range(100, 132))
    a.remember(router.hashes(prompt))
    assert a.cached_blocks(router.hashes(prompt)) == 2
    assert router.choose(prompt, router.hashes(prompt)).matched_tokens == BS
    assert router.choose(prompt + [1], router.hashes(prompt + [1])).matched_tokens == 2 * BS


def test_only_the_leading_run_of_blocks_counts():
    """Equal tokens after a different first block are other keys and values: no match. A record of the
    later blocks alone (a tree with a hole) matches nothing either."""
    a, b, router = two()
    prompt = list(range(100, 196))
    a.remember(prefix_hashes([7] * BS + prompt[BS:], BS))
    b.remember(prefix_hashes(prompt, BS)[1:])
    assert a.cached_blocks(router.hashes(prompt)) == 0 and b.cached_blocks(router.hashes(prompt)) == 0
    assert router.choose(prompt, router.hashes(prompt)).reason == "load"


def test_imbalance_overrides_the_prefix_and_a_small_match_goes_to_the_least_loaded():
    a, b, router = two(balance_abs=8, balance_rel=1.5)
    prompt = list(range(100, 196))
    a.remember(router.hashes(prompt))
    a.in_flight, b.in_flight = 9, 0
    assert router.choose(prompt, router.hashes(prompt)).replica is b  # 9 - 0 > 8: balance
    a.in_flight, b.in_flight = 8, 0
    assert router.choose(prompt, router.hashes(prompt)).replica is a  # 8 - 0 is not > 8: the prefix decides
    a.in_flight, b.in_flight = 30, 21
    assert router.choose(prompt, router.hashes(prompt)).replica is a  # 30 - 21 > 8 but 30 < 1.5 x 21: the prefix
    a.in_flight, b.in_flight = 2, 1
    longer = prompt[:16] + list(range(500, 600))  # a holds 16 of 116 tokens: under the 0.3 threshold
    assert router.choose(longer, router.hashes(longer)).replica is b


def test_round_robin_alternates_and_skips_replicas_that_are_down():
    a, b, router = two("round-robin")
    c = Replica("http://c")
    router.replicas.append(c)
    picks = [router.choose([1] * 40, router.hashes([1] * 40)).replica for _ in range(6)]
    assert sorted(p.url for p in picks) == ["http://a", "http://a", "http://b", "http://b", "http://c", "http://c"]
    assert all(x is not y for x, y in zip(picks, picks[1:]))
    router.mark_down(b, "refused")
    assert b not in {router.choose([1], []).replica for _ in range(4)}


def test_record_forgets_the_least_recently_sent_blocks_beyond_the_replica_capacity():
    r = Replica("http://a", capacity_blocks=4)
    r.remember([1, 2, 3, 4])
    r.remember([1])  # sent again: the most recent now
    r.remember([5, 6])
    assert list(r.record) == [4, 1, 5, 6]


def test_no_replica_left_names_each_state():
    a, b, router = two()
    router.mark_down(a, "ConnectError")
    assert not a.record
    with pytest.raises(NoReplica, match=r"http://a is down \(ConnectError\); http://b is refused"):
        router.choose([1], [], exclude=[b])
    with pytest.raises(ValueError, match="no routing policy"):
        Router([a], "random")


# ----------------------------------------------------------------------------- real replicas

def start(n: int, *args: str) -> list[BackgroundServer]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: BackgroundServer(*TINY, *args), range(n)))


@pytest.fixture(scope="module")
def replicas():
    servers = start(2)
    yield servers
    for s in servers:
        s.stop()


def counters(servers) -> list[dict]:
    return [scrape(s.url) for s in servers]


def gained(before, after, name) -> list[float]:
    return [a.get(name, 0) - b.get(name, 0) for b, a in zip(before, after)]


def chat(url: str, messages: list[dict], max_tokens: int = 16, **extra) -> httpx.Response:
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0} | extra
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def session(url: str, system: str, turns: int, stream: bool = False) -> list[dict]:
    """A multi-turn chat through ``url``, every turn resending the conversation; returns it."""
    messages = [{"role": "system", "content": system}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"question {t}: what does the text say about turn {t}?"})
        if stream:
            with httpx.stream("POST", url + "/v1/chat/completions", timeout=120,
                              json={"model": "tiny", "messages": messages, "max_tokens": 16, "temperature": 0,
                                    "stream": True}) as r:
                assert r.status_code == 200
                lines = [line for line in r.iter_lines() if line.startswith("data: {")]
            answer = "".join(json.loads(x[6:])["choices"][0]["delta"].get("content", "") for x in lines
                             if json.loads(x[6:])["choices"])
        else:
            reply = chat(url, messages)
            assert reply.status_code == 200, reply.text
            answer = reply.json()["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": answer})
    return messages


SYSTEM = "You are a careful assistant. Answer from this reference text: " + " ".join(
    f"clause {i} says the value of key {i} is {i * 7}." for i in range(20))


@pytest.mark.parametrize("stream", [False, True])
def test_prefix_routing_keeps_a_session_on_one_replica_and_round_robin_spreads_it(replicas, stream):
    """Evidence from the replicas' own counters: under prefix routing one replica computes every turn and
    serves later turns' history from its cache; round-robin sends turns to both, and each replica misses
    the turns the other served."""
    hits = {}
    for policy in ("prefix", "round-robin"):
        with RouterThread([s.url for s in replicas], policy, block_size=BS) as router:
            before = counters(replicas)
            session(router.url, f"[{policy} {stream}] " + SYSTEM, turns=4, stream=stream)
            after = counters(replicas)
            expected = scrape(router.url)["llmsys_router_matched_tokens_total"]
        prompt = gained(before, after, "llmsys_prompt_tokens_total")
        hits[policy] = sum(gained(before, after, "llmsys_prefix_cache_hit_tokens_total"))
        # one turn at a time, nothing evicted: the router's record mirrors the caches exactly, which holds
        # only if it renders and hashes each prompt as the replicas do
        assert expected == hits[policy], (expected, hits[policy])
        if policy == "prefix":
            assert sorted(prompt)[0] == 0 and sorted(prompt)[1] > 0, prompt
        else:
            assert min(prompt) > 0, prompt
    assert hits["prefix"] > hits["round-robin"] > 0, hits


def test_answers_pass_through_unchanged(replicas):
    messages = [{"role": "user", "content": "def main():"}]
    direct = chat(replicas[0].url, messages, 40).json()
    with RouterThread([replicas[0].url]) as router:
        routed = chat(router.url, messages, 40).json()
        models = httpx.get(router.url + "/v1/models").json()
    assert routed["choices"] == direct["choices"] and routed["usage"] == direct["usage"]
    assert models["data"][0]["id"] == "tiny"


def owner(servers, worker=None) -> int:
    """The replica running a request now (polls its /metrics), while ``worker`` waits for its answer."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (worker and not worker.is_alive()):
        for i, s in enumerate(servers):
            if s.proc.poll() is None and scrape(s.url).get("llmsys_requests_running", 0) >= 1:
                return i
        time.sleep(0.02)
    raise AssertionError("no replica started the request")


def test_replica_killed_mid_session_the_session_goes_on_elsewhere():
    """SIGKILL the replica that holds the session while it computes a non-streaming answer: the client
    still gets the whole answer (retried on a live replica), and the next turns succeed there."""
    servers = start(3)
    try:
        with RouterThread([s.url for s in servers], timeouts=Timeouts(interval=0.2)) as router:
            messages = session(router.url, "[kill] You are a terse assistant.", turns=2)
            messages.append({"role": "user", "content": "now write a very long answer"})
            answer = {}
            worker = threading.Thread(target=lambda: answer.update(reply=chat(router.url, messages, 800)))
            worker.start()
            victim = owner(servers, worker)
            servers[victim].proc.kill()
            worker.join(120)
            assert answer["reply"].status_code == 200, answer["reply"].text
            assert answer["reply"].json()["usage"]["completion_tokens"] == 800
            dead = router.router.replicas[victim]
            assert dead.state == "down" and not dead.record
            live = [s for i, s in enumerate(servers) if i != victim]
            before = counters(live)
            long_answer = answer["reply"].json()["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": long_answer})
            for t in range(2):
                messages.append({"role": "user", "content": f"and then {t}?"})
                reply = chat(router.url, messages)
                assert reply.status_code == 200, reply.text
                messages.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]})
            assert sum(gained(before, counters(live), "llmsys_prefix_cache_hit_tokens_total")) > 0
    finally:
        for s in servers:
            s.stop()


def test_a_stream_whose_replica_dies_ends_with_an_error_event_and_all_down_is_503():
    servers = start(2)
    try:
        with RouterThread([s.url for s in servers], timeouts=Timeouts(interval=0.2)) as router:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1000,
                    "stream": True}
            with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=60) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: {")  # the stream has begun: it cannot be replayed
                servers[owner(servers)].proc.kill()
                rest = [line for line in lines if line]  # ends (no hang: the timeout would raise)
            assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2]
            assert '"finish_reason": "error"' in rest[-3]
            for s in servers:
                s.proc.kill()
            reply = chat(router.url, [{"role": "user", "content": "x"}])
            assert reply.status_code == 503 and reply.headers["retry-after"]
            assert "is down" in reply.json()["error"]["message"]
            assert httpx.get(router.url + "/health").status_code == 503
    finally:
        for s in servers:
            s.stop()


# health checks after 1 s of silence, each answered within 1 s or the replica is hung
QUICK = Timeouts(first_byte=1.0, stream_idle=1.0, health=1.0, interval=0.5)


def stream_lines(url: str, max_tokens: int):
    """A streamed chat request through ``url`` (``with stream_lines(...) as response``)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": max_tokens,
            "stream": True, "temperature": 0}
    return httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60)


def labelled(url: str, name: str, **labels) -> float:
    """The sum of a Prometheus counter's samples at ``url`` whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics").text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())


def wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {seconds} s"
        time.sleep(0.05)


def test_a_hung_replica_mid_answer_is_retried_elsewhere_and_used_again_once_it_answers():
    """SIGSTOP the replica computing a non-streaming answer: the kernel still accepts connections to it and
    nothing answers, so only its failed health check tells the router. The answer comes whole from the
    other replica within seconds (not the 600 s read timeout), new requests go there too, a stream that
    had sent events on the stopped replica ends with an error event, and after SIGCONT the replica passes
    its health check and takes requests again."""
    servers = start(2)
    try:
        with RouterThread([s.url for s in servers], "round-robin", timeouts=QUICK) as router:
            messages = [{"role": "user", "content": "write a long answer"}]
            answer = {}
            worker = threading.Thread(target=lambda: answer.update(reply=chat(router.url, messages, 600)))
            worker.start()
            stopped = owner(servers, worker)
            os.kill(servers[stopped].proc.pid, signal.SIGSTOP)
            hung_at = time.monotonic()
            worker.join(60)
            assert time.monotonic() - hung_at < 15, "the router waited on the stopped replica"
            assert answer["reply"].status_code == 200, answer["reply"].text
            assert answer["reply"].json()["usage"]["completion_tokens"] == 600  # whole, from the other replica
            assert router.router.replicas[stopped].state == "down"
            live = servers[1 - stopped]
            t0 = time.monotonic()
            for _ in range(3):  # round-robin would give one of them to the stopped replica
                assert chat(router.url, messages, 4).status_code == 200
            assert time.monotonic() - t0 < 15
            assert labelled(router.url, "llmsys_router_retries_total", why="hung") >= 1
            assert labelled(router.url, "llmsys_router_requests_total", replica=live.url) >= 4

            os.kill(servers[stopped].proc.pid, signal.SIGCONT)
            wait_for(lambda: all(r.state == "up" for r in router.router.replicas), 15, "the replica came back")
            before = counters(servers)
            for _ in range(4):
                assert chat(router.url, messages, 4).status_code == 200
            assert min(gained(before, counters(servers), "llmsys_prompt_tokens_total")) > 0  # both used again

            # the resumed replica may still be computing the answer it was stopped in: wait, so that the replica
            # running a request next is the one streaming it
            wait_for(lambda: not any(scrape(s.url).get("llmsys_requests_running", 0) for s in servers), 60,
                     "the replicas finished what they were running")
            with stream_lines(router.url, 1000) as r:
                lines = (line for line in r.iter_lines() if line)
                assert next(lines).startswith("data: {")  # the stream has begun: it cannot be replayed
                stopped = owner(servers)
                os.kill(servers[stopped].proc.pid, signal.SIGSTOP)
                hung_at = time.monotonic()
                rest = list(lines)
            assert time.monotonic() - hung_at < 15
            assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2] and '"finish_reason": "error"' in rest[-3]
    finally:
        for s in servers:
            if s.proc.poll() is None:
                os.kill(s.proc.pid, signal.SIGCONT)  # never leave a stopped process behind
            s.stop()


def test_slow_answers_are_not_taken_for_hung_replicas(replicas):
    """With health checks after 0.1 s of silence, a non-streaming answer (its headers come after its last
    token) and a stream both take longer than that: they end whole, on their first replica, no retry and
    no replica marked down, because the replica answers its health checks while it computes."""
    timeouts = Timeouts(first_byte=0.1, stream_idle=0.1, health=1.0, interval=0.5)
    with RouterThread([s.url for s in replicas], "round-robin", timeouts=timeouts) as router:
        t0 = time.monotonic()
        reply = chat(router.url, [{"role": "user", "content": "x"}], 600)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 600
        assert time.monotonic() - t0 > 0.3, "the answer is too quick to show anything; ask for more tokens"
        t0 = time.monotonic()
        with stream_lines(router.url, 600) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
        assert time.monotonic() - t0 > 0.3
        assert all(r.state == "up" for r in router.router.replicas)
        assert labelled(router.url, "llmsys_router_retries_total") == 0


def test_busy_replicas_pass_the_request_on_then_pass_the_429_back():
    """Replicas that run one request and queue none. Two long requests at once whose prompt one replica
    holds: the prefix sends both there, and its 429 sends the second to the other, so both succeed. A
    third at once finds both busy and gets the 429 with Retry-After."""
    servers = start(2, "--max-num-seqs", "1", "--max-queue", "0")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x " * 20}], "max_tokens": 900}

    async def burst(url, n):
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(url + "/v1/chat/completions", json=body) for _ in range(n)))

    try:
        with RouterThread([s.url for s in servers]) as router:
            assert chat(router.url, body["messages"], 1).status_code == 200  # one replica holds the prompt now
            before = counters(servers)
            assert [r.status_code for r in asyncio.run(burst(router.url, 2))] == [200, 200]
            assert min(gained(before, counters(servers), "llmsys_prompt_tokens_total")) > 0  # one went elsewhere
            replies = asyncio.run(burst(router.url, 3))
    finally:
        for s in servers:
            s.stop()
    assert sorted(r.status_code for r in replies) == [200, 200, 429]
    refused = next(r for r in replies if r.status_code == 429)
    assert refused.headers["retry-after"] and refused.json()["error"]["type"] == "rate_limit_error"


@pytest.mark.parametrize("urls, message", [
    (["not-a-url"], "is not a replica URL"),
    ([f"http://127.0.0.1:{free_port()}"], "no OpenAI-compatible server answers"),
])
def test_bad_replica_urls_fail_on_the_command_line(urls, message):
    done = subprocess.run([sys.executable, "-m", "llmsys", "serve-router", "--replicas", *urls, "--port",
                           str(free_port())], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr
