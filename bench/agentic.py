"""A seeded synthetic agentic workload: coding-agent sessions that share a long tool prompt.

What agents do, reduced to what matters for a KV cache (docs/benchmarks.md, "KV pressure"):

* **Main agents** all open with the same system + tool-definition prompt
  (``SHARED_PROMPT_TOKENS`` ≈ 1.3k tokens, like a coding agent's tool schema), then a task
  (a user message of ``TASK_TOKENS``). Each turn the agent answers (``max_tokens`` in
  ``ANSWER_TOKENS``, the tool call), the tool runs (``think_s``: seeded, exponential with mean
  ``THINK_MEAN_S``, capped at ``THINK_CAP_S``) and the next turn adds its result (a user message
  of ``TOOL_RESULT_TOKENS``) after the previous answer: the prompt grows every turn and each
  turn's prompt extends the previous one.
* **Sub-agents**: after a turn, with probability ``SPAWN_P`` the agent delegates to a sub-agent
  (one of ``SUB_KINDS`` kinds, each with its own system prompt of ``SUB_PROMPT_TOKENS`` shared by
  every sub-agent of that kind) that runs ``SUB_TURNS`` turns while its parent waits; its last
  answer opens the parent's next tool result. Sub-agents send ``x-parent-session-id``.
* **Sessions end** after a seeded number of turns (``TURNS``) or when the next turn would pass
  ``PROMPT_BUDGET`` estimated tokens, so every prompt stays below the engines'
  ``--max-model-len`` 4096 with room for the answer.

Concurrency (:data:`LEVELS`): ``slots`` agents run at once, each a closed loop (it waits for its
answer, then for its tool); a slot that finishes an agent starts the next one from the queue.
Text is seeded pseudo-code (tool output is mostly code); token counts come from a ``Counter``
(the served model's tokenizer in the benchmark), so plans are exact for that tokenizer and
deterministic for a seed. Constants are fixed: do not tune them to flatter a router.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

Counter = Callable[[str], int]

SHARED_PROMPT_TOKENS = 1_300
SUB_KINDS = 2
SUB_PROMPT_TOKENS = 600
TASK_TOKENS = (100, 300)
TOOL_RESULT_TOKENS = (150, 400)
ANSWER_TOKENS = (16, 32)
TURNS = (4, 10)
SUB_TURNS = (2, 4)
SPAWN_P = 0.2
THINK_MEAN_S = 0.5
THINK_CAP_S = 2.0
#: Largest estimated prompt (tokens): 4,096 - 32 answer tokens - ~260 of estimation slack.
PROMPT_BUDGET = 3_800
#: Chat-template tokens around one message (header ids, role, blank line, end of turn).
MESSAGE_OVERHEAD = 6
#: Estimate of an answer's length once re-tokenized as text: generated tokens decode to bytes
#: that may tokenize differently; twice the generated count is a safe bound in practice.
ANSWER_ESTIMATE = 2

WORDS = (
    "self", "data", "value", "result", "path", "name", "items", "config", "buffer", "index",
    "request", "response", "handler", "token", "cache", "engine", "block", "offset", "length",
    "context", "state", "error", "stream", "header", "payload", "parser", "record", "entry",
    "window", "limit", "timeout", "count", "prefix", "suffix", "module", "source", "target",
)
KEYWORDS = ("def", "return", "if", "for", "while", "with", "yield", "raise", "import", "class")


@dataclass(frozen=True, slots=True)
class Level:
    """A concurrency level: agents running at once, agents in all."""

    slots: int
    agents: int


#: low: a handful of agents interleaved (the reported case); high: many at once.
LEVELS: dict[str, Level] = {"low": Level(slots=6, agents=10), "high": Level(slots=12, agents=14)}


@dataclass(frozen=True, slots=True)
class Turn:
    """One request: wait ``think_s``, add ``user`` (``user_tokens``), ask ``max_tokens``."""

    think_s: float
    user: str
    user_tokens: int
    max_tokens: int
    spawn: SubAgent | None = None  # runs after this turn's answer; opens the next tool result


@dataclass(frozen=True, slots=True)
class SubAgent:
    sid: str
    kind: int
    turns: tuple[Turn, ...]


@dataclass(frozen=True, slots=True)
class Agent:
    sid: str
    start_s: float  # think time before its first request (the user starting it)
    turns: tuple[Turn, ...]


@dataclass(frozen=True, slots=True)
class Workload:
    seed: int
    level: str
    slots: int
    shared_prompt: str
    sub_prompts: tuple[str, ...]
    agents: tuple[Agent, ...]

    def requests(self) -> int:
        """Requests the workload sends (main turns and sub-agent turns)."""
        return sum(len(t.spawn.turns) if t.spawn else 0 for a in self.agents for t in a.turns) \
            + sum(len(a.turns) for a in self.agents)


def _line(rng: random.Random) -> str:
    w = [rng.choice(WORDS) for _ in range(4)]
    kind = rng.randrange(4)
    if kind == 0:
        return f"def {w[0]}_{w[1]}({w[2]}, {w[3]}={rng.randrange(99)}):"
    if kind == 1:
        return f"    {w[0]} = {w[1]}.{w[2]}({w[3]}[{rng.randrange(64)}])"
    if kind == 2:
        k = rng.choice(KEYWORDS)
        return f"    {k} {w[0]} {rng.choice(KEYWORDS)} {w[1]}_{rng.randrange(999)}"
    return f"# {w[0]} {w[1]} {w[2]} {rng.randrange(10_000)}"


def text(rng: random.Random, tokens: int, count: Counter) -> tuple[str, int]:
    """Seeded pseudo-code of about ``tokens`` tokens (stops at the first line reaching it);
    returns the text and its token count."""
    lines: list[str] = []
    used = 0
    while used < tokens:
        line = _line(rng) + "\n"
        lines.append(line)
        used += count(line)
    body = "".join(lines)
    return body, count(body)


def _think(rng: random.Random) -> float:
    return round(min(rng.expovariate(1.0 / THINK_MEAN_S), THINK_CAP_S), 3)


def _turn_cost(user_tokens: int, max_tokens: int) -> int:
    """Estimated prompt growth of one turn: its user message and the answer it gets."""
    return user_tokens + max_tokens * ANSWER_ESTIMATE + 2 * MESSAGE_OVERHEAD


def _turns(rng: random.Random, count: Counter, start: int, first: tuple[int, int],
           turns: int) -> tuple[list[Turn], int]:
    """Up to ``turns`` turns (first message sized ``first``, then tool results) while the
    estimated prompt stays within the budget; returns them and the final estimate."""
    out: list[Turn] = []
    size = start
    for i in range(turns):
        want = rng.randint(*(first if i == 0 else TOOL_RESULT_TOKENS))
        answer = rng.randint(*ANSWER_TOKENS)
        body, used = text(rng, want, count)
        if size + _turn_cost(used, answer) + MESSAGE_OVERHEAD > PROMPT_BUDGET:
            break
        out.append(Turn(_think(rng), body, used, answer))
        size += _turn_cost(used, answer)
    return out, size


def _sub_agent(rng: random.Random, count: Counter, sid: str, prompt_tokens: int) -> SubAgent:
    kind = rng.randrange(SUB_KINDS)
    turns, _ = _turns(rng, count, prompt_tokens, TASK_TOKENS, rng.randint(*SUB_TURNS))
    return SubAgent(sid, kind, tuple(turns))


def _agent(rng: random.Random, count: Counter, sid: str, shared: int, sub: int) -> Agent:
    turns, _ = _turns(rng, count, shared, TASK_TOKENS, rng.randint(*TURNS))
    spawned: list[Turn] = []
    for i, turn in enumerate(turns):
        if i + 1 < len(turns) and rng.random() < SPAWN_P:
            child = _sub_agent(rng, count, f"{sid}.sub-{i}", sub)
            turn = Turn(turn.think_s, turn.user, turn.user_tokens, turn.max_tokens, child)
        spawned.append(turn)
    return Agent(sid, _think(rng), _fit_results(spawned, shared))


def _fit_results(turns: list[Turn], shared: int) -> tuple[Turn, ...]:
    """Drop trailing turns until the estimate, with each sub-agent's answer added to the
    parent's next turn, fits the budget again."""
    while turns:
        extra = sum(t.spawn.turns[-1].max_tokens * ANSWER_ESTIMATE + MESSAGE_OVERHEAD
                    for t in turns[:-1] if t.spawn and t.spawn.turns)
        size = shared + sum(_turn_cost(t.user_tokens, t.max_tokens) for t in turns) + extra
        if size + MESSAGE_OVERHEAD <= PROMPT_BUDGET:
            break
        turns = turns[:-1]
    if turns and turns[-1].spawn is not None:  # nothing left to report a last sub-agent to
        last = turns[-1]
        turns[-1] = Turn(last.think_s, last.user, last.user_tokens, last.max_tokens)
    return tuple(turns)


def build(seed: int, level: str, count: Counter, spec: Level | None = None) -> Workload:
    """The workload of ``level`` for ``seed``: the same seed gives the same workload.
    ``spec`` overrides the level's size (a smaller run of the same kind of agents)."""
    spec = spec or LEVELS[level]
    rng = random.Random(f"agentic:{seed}:{level}")
    prompts = random.Random(f"agentic-prompts:{seed}")  # the same prompts at every level
    shared = "You are a coding agent. Call one tool per turn. Tools:\n" + text(
        prompts, SHARED_PROMPT_TOKENS, count)[0]
    sub_prompts = tuple(f"You are sub-agent {k}. Report back in one line.\n"
                        + text(prompts, SUB_PROMPT_TOKENS, count)[0] for k in range(SUB_KINDS))
    shared_tokens = count(shared) + MESSAGE_OVERHEAD + 1  # + BOS
    sub_tokens = max(count(p) for p in sub_prompts) + MESSAGE_OVERHEAD + 1
    agents = tuple(_agent(rng, count, f"agent-{i}", shared_tokens, sub_tokens)
                   for i in range(spec.agents))
    return Workload(seed, level, spec.slots, shared, sub_prompts, agents)
