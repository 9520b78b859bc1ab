"""A wide, seeded, parametric family of prefix-cache workloads (pure Python).

``draw(seed)`` picks a point in the knob space below; ``generate(params)`` turns it into a list of
``Request`` (same type as ``sglang_tiered.dev.workloads``). Same seed, same workload, on every
platform. Knobs (each drawn per workload; see ``draw``):

* tenants 1-64 (Zipf popularity across tenants), each with its own shared prefixes (system
  prompts, tool preambles, documents) picked with Zipf skew 0.6-1.4;
* prompt length: a typical shared-prefix length drawn log-uniformly in 64-32k tokens and scaled
  down by ``token_scale`` (default 1/8, at least one 16-token page) so 200 workloads replay in
  minutes; the shape (the ratio of prefix, turn and scan lengths) is kept;
* conversations: depth 1-30 turns, think-time (requests between a conversation's turns) drawn
  log-uniformly in 1-3000: short loops to long reuse gaps;
* agentic runs: a tenant's tool preamble plus a transcript growing by small steps, many quick
  steps in a row;
* RAG: shared prefix + a Zipf-popular document + a fresh question;
* one-shot scans (long unique prompts), 0-80 % of requests;
* periodic batch jobs: every ``batch_period`` requests the same set of documents is sent again
  (a scan that looks cold but returns at a fixed reuse distance);
* phase changes: with probability 1/2 the mix, the skew and the think-time are redrawn part way
  through the trace.
"""

from __future__ import annotations

import heapq
import math
import random
from array import array
from dataclasses import asdict, dataclass, field

from sglang_tiered.dev.workloads import TOKEN_HI, TOKEN_LO, Request

KINDS = ("chat", "agent", "rag", "scan", "batch")


@dataclass
class Mix:
    weights: dict  # kind -> weight (normalised when drawn)
    zipf: float  # skew of shared-prefix and document popularity
    think: float  # mean requests between a conversation's turns
    agent_think: float  # mean requests between an agent's steps


@dataclass
class FamilyParams:
    seed: int
    n_requests: int
    tenants: int
    tenant_zipf: float
    prefix_tokens: int  # typical shared prefix length (already scaled)
    n_prefixes: int  # shared prefixes per tenant
    n_docs: int  # RAG documents per tenant
    conv_depth: int
    turn_tokens: int
    agent_steps: int
    step_tokens: int
    scan_tokens: int
    batch_period: int
    batch_size: int
    mix: Mix
    phase_at: float | None = None  # fraction of the trace where the mix switches
    mix2: Mix | None = None
    token_scale: float = 0.125
    tags: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _loguniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _draw_mix(rng: random.Random) -> Mix:
    w = {k: rng.random() ** 2 for k in KINDS}  # squared: mixes dominated by one or two kinds
    if rng.random() < 0.25:
        w["batch"] = 0.0
    tot = sum(w.values()) or 1.0
    w = {k: v / tot for k, v in w.items()}
    scan = rng.uniform(0.0, 0.8) if rng.random() < 0.7 else 0.0
    rest = 1.0 - w["scan"]
    w = {k: (v / rest * (1.0 - scan) if rest > 0 else (1.0 - scan) / 4) for k, v in w.items() if k != "scan"}
    w["scan"] = scan
    return Mix(w, rng.uniform(0.6, 1.4), _loguniform(rng, 1, 3000), _loguniform(rng, 1, 8))


def draw(seed: int, n_requests: tuple[int, int] = (500, 1200), token_scale: float = 0.125) -> FamilyParams:
    """One point of the knob space (deterministic in ``seed``)."""
    rng = random.Random(f"sglang-tiered-family:{seed}")
    s = lambda toks: max(16, int(toks * token_scale))  # noqa: E731
    prefix = _loguniform(rng, 64, 32768)
    p = FamilyParams(
        seed=seed,
        n_requests=rng.randint(*n_requests),
        tenants=int(round(_loguniform(rng, 1, 64))),
        tenant_zipf=rng.uniform(0.3, 1.2),
        prefix_tokens=s(prefix),
        n_prefixes=rng.randint(1, 12),
        n_docs=rng.randint(4, 60),
        conv_depth=rng.randint(1, 30),
        turn_tokens=s(_loguniform(rng, 32, 1024)),
        agent_steps=rng.randint(5, 50),
        step_tokens=s(_loguniform(rng, 32, 512)),
        scan_tokens=s(prefix * _loguniform(rng, 0.5, 4)),
        batch_period=rng.randint(50, 600),
        batch_size=rng.randint(4, 40),
        mix=_draw_mix(rng),
        token_scale=token_scale,
    )
    if rng.random() < 0.5:
        p.phase_at = rng.uniform(0.3, 0.7)
        p.mix2 = _draw_mix(rng)
    return p


def generate(p: FamilyParams) -> list[Request]:
    rng = random.Random(f"sglang-tiered-family-gen:{p.seed}")
    span = TOKEN_HI - TOKEN_LO

    def fresh(n: int) -> list[int]:
        return [TOKEN_LO + b % span for b in array("H", rng.randbytes(2 * max(1, n)))]

    def jitter(n: int) -> int:
        return max(1, int(n * rng.uniform(0.5, 1.5)))

    def zipf(n: int, s: float) -> int:
        # inverse-CDF over a small catalogue (n <= a few hundred)
        x = rng.random() * sum(1.0 / (i + 1) ** s for i in range(n))
        for i in range(n):
            x -= 1.0 / (i + 1) ** s
            if x <= 0:
                return i
        return n - 1

    tenants = [f"t{i}" for i in range(p.tenants)]
    prefixes = {t: [fresh(jitter(p.prefix_tokens)) for _ in range(p.n_prefixes)] for t in tenants}
    docs = {t: [fresh(jitter(p.prefix_tokens)) for _ in range(p.n_docs)] for t in tenants}
    tools = {t: fresh(jitter(p.prefix_tokens)) for t in tenants}
    batch_template = fresh(max(16, p.turn_tokens))
    batch_docs = [fresh(jitter(p.scan_tokens)) for _ in range(p.batch_size)]
    convs: list = []  # heap of (due request index, seq, tenant, tokens, turns left)
    agents: list = []
    seq = 0
    out: list[Request] = []
    batch_left = 0
    batch_next = p.batch_period
    kinds = list(KINDS)
    for i in range(p.n_requests):
        mix = p.mix2 if (p.phase_at is not None and i >= p.phase_at * p.n_requests) else p.mix
        if mix.weights.get("batch", 0) > 0 and i >= batch_next and batch_left == 0:
            batch_left, batch_next = p.batch_size, i + p.batch_period
        if batch_left:
            toks = batch_template + batch_docs[p.batch_size - batch_left]
            batch_left -= 1
            out.append(Request(array("q", toks), "batch", "batch", float(i)))
            continue
        t = tenants[zipf(len(tenants), p.tenant_zipf)] if len(tenants) > 1 else tenants[0]
        x = rng.random()
        kind = kinds[-1]
        for k in kinds:
            x -= mix.weights.get(k, 0.0) if k != "batch" else 0.0
            if x <= 0:
                kind = k
                break
        if kind == "batch":  # only reached through rounding: treat as a chat
            kind = "chat"
        if kind == "chat":
            if convs and convs[0][0] <= i:
                _, _, t, toks, left = heapq.heappop(convs)
                toks = toks + fresh(jitter(p.turn_tokens))
            else:
                toks = prefixes[t][zipf(p.n_prefixes, mix.zipf)] + fresh(jitter(p.turn_tokens))
                left = rng.randint(1, p.conv_depth)
            if left > 1:
                seq += 1
                heapq.heappush(convs, (i + 1 + int(rng.expovariate(1.0 / mix.think)), seq, t, toks, left - 1))
        elif kind == "agent":
            if agents and agents[0][0] <= i:
                _, _, t, toks, left = heapq.heappop(agents)
                toks = toks + fresh(jitter(p.step_tokens))
            else:
                toks = tools[t] + fresh(jitter(p.step_tokens))
                left = rng.randint(2, p.agent_steps)
            if left > 1:
                seq += 1
                heapq.heappush(agents, (i + 1 + int(rng.expovariate(1.0 / mix.agent_think)), seq, t, toks, left - 1))
        elif kind == "rag":
            toks = prefixes[t][zipf(p.n_prefixes, mix.zipf)] + docs[t][zipf(p.n_docs, mix.zipf)] + fresh(
                jitter(max(16, p.turn_tokens // 4)))
        else:  # one-shot scan
            toks = fresh(jitter(p.scan_tokens))
        out.append(Request(array("q", toks), t, kind, float(i)))
    return out


def family(n: int, start: int = 0, **kw) -> list[FamilyParams]:
    return [draw(seed, **kw) for seed in range(start, start + n)]
