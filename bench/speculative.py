"""`treadle bench engine --speculative`: three workloads, with and without speculative decoding.

- edit: rename a method in a pasted 150-line Python file and output the whole file (greedy): the answer
  repeats the context almost token for token, where drafts from the context pay most;
- quote: answer questions about a pasted document by quoting it (seeded sampling, temperature 0.7);
- chat: free writing with nothing to copy (seeded sampling, temperature 0.8): drafts mostly fail, and
  `auto` must turn them off by itself;
- unique: every stream its own short question (about 50 tokens, nothing shared, so the prompts are
  prefilled in the measured time, as a server's traffic is), greedy: drafts have little to copy.

Each workload runs at each concurrency level with speculation off and `auto`, `rounds` times in the
order off, auto, auto, off, ... (a drift of the host cancels), on one engine (its scheduler's mode
switched between runs, so both sides share the pool, the cache and the machine's minute). Every
request of a level is submitted at once; the rate is all their tokens over the time from submission
to the last token. The workload's prompt is prefilled once first, so the prefix cache serves it and
the rate is the decode's.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.engine_streams import generate_together
from decoding.engine.engine import Engine
from decoding.engine.params import SamplingParams
from decoding.model.model import Model

DATA = Path(__file__).parent / "data"


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    message: str
    temperature: float
    unique_prompts: bool = False  # each request asks its own variant of `message` (nothing cached)

    def prompts(self, model: Model, numbers: list[int]) -> list[list[int]]:
        """The prompts of requests numbered `numbers`: the same one, or (unique) one of its own each."""
        if not self.unique_prompts:
            return [model.tokenizer.encode_chat([{"role": "user", "content": self.message}])] * len(numbers)
        return [model.tokenizer.encode_chat([{"role": "user", "content": self.message.format(
            number=number, topic=UNIQUE_TOPICS[number % len(UNIQUE_TOPICS)])}]) for number in numbers]


UNIQUE_TOPICS = ("tides", "bread", "glaciers", "violins", "compilers", "bees", "bridges", "ink", "comets",
                 "salt", "trains", "moss", "clocks", "whales", "paper", "volcanoes")
_REQUEST_NUMBERS = itertools.count()  # a fresh number per request: no unique prompt is ever in the prefix cache


def workloads() -> list[Workload]:
    source = (DATA / "edit_workload_source.py.txt").read_text()
    document = (DATA / "quote_workload_document.txt").read_text()
    return [
        Workload("edit", "Rename the method `release` to `drop_reference` everywhere in this file (its definition "
                 "and every call) and output the whole file, unchanged otherwise.\n\n```python\n" + source + "```",
                 0.0),
        Workload("quote", document + "\nAnswer by quoting the document word for word: when and where did the "
                 "treadle loom appear, what did it change for the weaver, and when did it reach Europe?", 0.7),
        Workload("chat", "Write a short story about a lighthouse keeper who finds a message in a bottle.", 0.8),
        Workload("unique", "Question {number}: explain in a few paragraphs how {topic} work, what people "
                 "usually get wrong about them, and one thing about {topic} that surprised the experts.", 0.0,
                 unique_prompts=True),
    ]  # fmt: skip


@dataclass(slots=True)
class Run:
    tokens_per_second: float
    drafted: int
    accepted: int


def run_once(engine: Engine, model: Model, workload: Workload, concurrency: int, max_tokens: int) -> Run:
    params = [SamplingParams(max_tokens=max_tokens, temperature=workload.temperature, seed=i, ignore_eos=True)
              for i in range(concurrency)]  # fmt: skip
    prompts = workload.prompts(model, [next(_REQUEST_NUMBERS) for _ in range(concurrency)])
    drafted, accepted = engine.stats.num_draft_tokens, engine.stats.num_accepted_draft_tokens
    tokens, seconds = generate_together(engine, prompts, params)
    return Run(tokens / seconds, engine.stats.num_draft_tokens - drafted,
               engine.stats.num_accepted_draft_tokens - accepted)


def measure_speculative(engine: Engine, model: Model, levels: list[int], max_tokens: int, rounds: int) -> dict:
    """Per workload and level: tokens/s without and with speculation (`auto`), medians of `rounds`
    runs of each (off, auto, auto, off, ...), their ratio, and the share of drafted tokens accepted."""
    mode = engine.scheduler.speculative
    results = []
    try:
        for workload in workloads():
            prompt_ids = workload.prompts(model, [0])[0]
            if not workload.unique_prompts:
                engine.generate(prompt_ids, SamplingParams(max_tokens=1))  # the prompt, cached for every run
            for level in levels:
                sides: dict[str, list[Run]] = {"off": [], "auto": []}
                for round_index in range(rounds):  # off, auto, auto, off, ...: a drift of the host cancels
                    for side in ("off", "auto") if round_index % 2 == 0 else ("auto", "off"):
                        engine.scheduler.speculative = side
                        sides[side].append(run_once(engine, model, workload, level, max_tokens))
                off, auto = (statistics.median(r.tokens_per_second for r in sides[s]) for s in ("off", "auto"))
                drafted, accepted = sum(r.drafted for r in sides["auto"]), sum(r.accepted for r in sides["auto"])
                results.append({"workload": workload.name, "concurrency": level, "prompt_tokens": len(prompt_ids),
                                "off_tokens_per_second": off, "auto_tokens_per_second": auto, "ratio": auto / off,
                                "drafted": drafted, "accepted": accepted,
                                "runs": {side: [asdict(r) for r in runs] for side, runs in sides.items()}})
                print(f"  {workload.name:>6} {level:>3} streams: {off:7.1f} → {auto:7.1f} tokens/s "
                      f"({auto / off:.2f}×)", flush=True)
    finally:
        engine.scheduler.speculative = mode
    return {"max_tokens": max_tokens, "rounds": rounds, "levels": results}


def format_speculative(report: dict) -> str:
    lines = [(f"speculative decoding (drafts from the context), {report['max_tokens']} tokens a request, medians of "
              f"{report['rounds']} runs each (off, auto, auto, off, ...):"),
             (f"{'workload':>9} {'streams':>8} {'off tok/s':>10} {'auto tok/s':>11} {'ratio':>7} {'drafted':>8} "
              f"{'accepted':>9}")]
    for r in report["levels"]:
        share = f"{r['accepted'] / r['drafted']:.0%}" if r["drafted"] else "-"
        lines.append(f"{r['workload']:>9} {r['concurrency']:>8} {r['off_tokens_per_second']:>10.1f} "
                     f"{r['auto_tokens_per_second']:>11.1f} {r['ratio']:>6.2f}× {r['drafted']:>8} {share:>9}")
    return "\n".join(lines)
