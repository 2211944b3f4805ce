"""The generation engine: a request queue with continuous batching over one paged KV cache.

    engine = Engine.from_checkpoint("runs/dmc_tiny_cr2.0", kv_bytes=64 << 20)
    for out in engine.generate(["To be, or not", "Friends, Romans"], SamplingParams(max_new_tokens=40)):
        print(out.text, out.compression)
    for event in engine.stream(prompts, params):          # tokens as they are produced
        print(event.text, end="")

Each :meth:`Engine.step`:

1. **admits** waiting requests (first come, first served) while the batch has room: the prompts
   admitted together are prefilled in one forward (packed, no padding: ``model.prefill_batch``; the
   cache decides what it keeps) and their first tokens sampled. A prompt that does not fit in the free
   pages waits until a running request ends and frees pages; one that cannot fit even in an empty pool
   fails with a one-line error.
2. **decodes** one token for every running request in one batched forward. The pages a step can
   take are reserved first, oldest request first; when they are not there, the newest running
   requests are **preempted** (as vLLM does): their pages go back to the pool and they wait at the
   head of the queue, to be recomputed from their prompt and the tokens they generated once pages
   free. A request fails only when its step cannot get its pages even with the pool to itself.
3. **finishes** requests (stop token, eos, stop string, max new tokens, the model's maximum
   positions) and returns their pages to the pool.

A request's tokens do not depend on the others in the batch (per-request positions, caches, seeds), nor
on being preempted: a recompute rebuilds its cache as its uninterrupted run built it (one prefill of
prompt + generated tokens when the cache's ``prefill_equals_decode`` says that is the same, else the
prompt's prefill and the generated tokens fed again through decode steps) and samples nothing, so a
seeded request's generator draws exactly once per generated token, in order, however often it is
preempted.
"""

from __future__ import annotations

import bisect
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from dmc_train.errors import InferenceError, OutOfPages
from dmc_train.inference.caches import KVCache, build_cache, check_cache
from dmc_train.inference.model import LlamaForInference
from dmc_train.inference.pool import PagePool
from dmc_train.inference.sampling import SamplingParams, StopChecker, make_generator, sample
from dmc_train.inference.tensor_parallel import TP_CACHES
from kernels.backend import choose


@dataclass
class Event:
    """One step's news about a request: a new token (``text`` is the new text) or its end. ``source``: the new
    text, or what computes it when ``text`` is first read (a request without stop strings is detokenised only
    when someone reads its text: :meth:`Engine._event_text`)."""

    request_id: int
    token: Optional[int]
    source: str | Callable[[], str]
    finished: bool = False
    finish_reason: Optional[str] = None
    error: Optional[str] = None

    @property
    def text(self) -> str:
        """The new text this event streams ("" while the output ends inside a multi-byte character)."""
        if callable(self.source):
            self.source = self.source()
        return self.source


@dataclass
class Output:
    """A finished request. ``entries [layers, H_kv]``: cache entries (DMC: slots) per head at the end;
    ``compression``: tokens / entries overall and ``per_layer``; ``kv_bytes``: what its rows held at the end."""

    request_id: int
    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    finish_reason: Optional[str]
    error: Optional[str] = None
    entries: Optional[list[list[int]]] = None
    compression: dict = field(default_factory=dict)
    kv_bytes: dict = field(default_factory=dict)
    preemptions: int = 0  # times its pages were taken back and it was recomputed


@dataclass
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    stop: StopChecker
    generator: Optional[torch.Generator]
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # the decoded output of the first ``text_tokens`` tokens
    text_tokens: int = 0
    streamed: str = ""  # the text already sent in events
    stream_texts: list[str] = field(default_factory=list)  # the text each token's event sent, once computed
    cached: int = 0  # tokens written into the cache (prompt, then generated ones); 0 while waiting
    preemptions: int = 0

    @property
    def position(self) -> int:  # position of the last sampled token
        return len(self.prompt) + len(self.tokens) - 1

    @property
    def replaying(self) -> bool:
        """True while a recompute feeds generated tokens again (the next decode step samples nothing)."""
        return self.cached < self.position

    @property
    def next_token(self) -> int:  # the token the next decode step feeds, at position ``cached``
        return self.tokens[self.cached - len(self.prompt)]


class Engine:
    """Continuous batching over one model and one cache (module docstring).

    Args:
        model: the :class:`LlamaForInference` to run.
        tokenizer: encodes string prompts and decodes outputs (None: prompts are token-id lists).
        cache: ``"auto"`` (the model's own: ``dmc`` for DMC / fixed-pooling models, else ``full``) or a name in
            ``CACHES`` (``full``, ``dmc``, ``less``, ``lightcache``, or any eviction policy of
            :data:`~dmc_train.policies.POLICIES`).
        page_size: entries per page (power of two >= 16).
        kv_bytes: the K/V page budget, in bytes or a size such as ``"64MB"`` (default: room for ``max_batch``
            sequences of the model's maximum length uncompressed, within a share of the device's free memory:
            :data:`~dmc_train.inference.pool.DEFAULT_MEMORY_SHARE`); :meth:`PagePool.for_budget` makes the pool on
            the model's device.
        max_batch: most requests running at once (rows of the block table).
        max_prefill_tokens: most prompt tokens prefilled together in one forward (it bounds the activations of
            a batched prefill; a longer prompt goes alone); None: no limit.
        cache_options: the cache's options, e.g. ``budget=128`` (entries; ``Budget.entries`` resolves a fraction),
            ``schedule="decode"``, ``recent_fraction=0.5`` (``docs/INFERENCE.md``).

    The model's device is the engine's (:attr:`device`): its pool and every cache's state live there; ``kernels``
    is the backend the ops run there (:func:`kernels.backend.choose`, once: ``DMC_KERNELS`` may force one).
    """

    def __init__(self, model: LlamaForInference, tokenizer: Any = None, cache: str = "auto", page_size: int = 16,
                 kv_bytes: int | str | None = None, max_batch: int = 16, max_prefill_tokens: Optional[int] = None,
                 **cache_options: Any):
        s = model.shape
        name = model.default_cache if cache == "auto" else cache
        check_cache(name, model)
        if model.group is not None and name not in TP_CACHES:
            raise InferenceError(f"the {name!r} cache does not run tensor-parallel; under tensor parallelism the "
                                 f"engine runs the {' and '.join(TP_CACHES)} caches")
        if max_batch < 1:
            raise InferenceError(f"max_batch={max_batch} must be >= 1")
        if max_prefill_tokens is not None and max_prefill_tokens < 1:
            raise InferenceError(f"max_prefill_tokens={max_prefill_tokens} must be >= 1 (or None: no limit)")
        if tokenizer is not None and tokenizer.vocab_size > s.vocab_size:
            raise InferenceError(f"the tokenizer has {tokenizer.vocab_size} ids but the model only {s.vocab_size}; "
                                 f"use the tokenizer the model was trained with")
        try:  # the kernels' backend on the model's device, once (kernels.backend: DMC_KERNELS may force one)
            self.kernels = choose(model.device)
        except RuntimeError as e:
            raise InferenceError(str(e)) from None
        rows_per_seq = s.num_layers * s.num_kv_heads  # one pool row per (layer, KV head) of a sequence
        self.pool = PagePool.for_budget(kv_bytes, page_size, s.head_dim, max_batch * rows_per_seq, s.max_positions,
                                        rows_per_seq, dtype=model.dtype, device=model.device)
        self.model, self.tokenizer = model, tokenizer
        # ids past the tokenizer's (a padded embedding) are never sampled
        self.vocab_limit = tokenizer.vocab_size if tokenizer is not None else s.vocab_size
        self.cache_name, self.cache_options, self.max_batch = name, cache_options, max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.cache = self.new_cache()
        # a cache that numbers positions itself (LightCache: a window at its own positions) has no length limit
        self.unbounded = self.cache.rope_in_cache
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.finished: dict[int, Output] = {}
        self._next_id = 0
        self._blocked_free = -1  # free pages when the head of the queue last failed to fit
        self.stats = {"prefill_tokens": 0, "prefill_s": 0.0, "decode_tokens": 0, "decode_s": 0.0, "max_running": 0,
                      "prefill_batches": 0, "preemptions": 0, "recomputed_tokens": 0}

    @staticmethod
    def kv_bytes_for(model: LlamaForInference, sequences: int, tokens: int, page_size: int = 16) -> int:
        """K/V page bytes that ``sequences`` uncompressed sequences of ``tokens`` tokens hold (the most any cache
        keeps): a ``kv_bytes`` sized to known requests."""
        s = model.shape
        pages = sequences * s.num_layers * s.num_kv_heads * -(-tokens // page_size)
        return pages * PagePool.bytes_per_page(page_size, s.head_dim, model.dtype)

    @property
    def device(self) -> torch.device:
        """Where the model, its pages and every cache's state live."""
        return self.model.device

    def new_cache(self) -> KVCache:
        """A cache of the engine's kind on the engine's pool (the engine's own is ``self.cache``)."""
        return build_cache(self.cache_name, self.pool, self.model, self.cache_options)

    @classmethod
    def from_checkpoint(cls, checkpoint: str, dtype: Optional[str] = None, tokenizer: Optional[str] = None,
                        tensor_parallel: int = 1, device: str | torch.device | None = None, **kwargs) -> "Engine":
        """An engine for a checkpoint of this project on ``device`` (``"cpu"``, the default, ``"cuda"``,
        ``"cuda:1"``: the model, its pages and every cache's state there); its tokenizer is ``tokenizer`` or the
        run's ``data.tokenizer`` when that file exists (else prompts must be token ids). ``tensor_parallel > 1``:
        this torchrun rank's shard of the model, its cache over its own KV heads (docs/INFERENCE.md)."""
        from dmc_train.data.tokenizer import load_tokenizer

        model, loaded = LlamaForInference.from_checkpoint(checkpoint, dtype, tensor_parallel, device)
        path = tokenizer or loaded.cfg.data.tokenizer
        if tokenizer and not os.path.exists(tokenizer):
            raise InferenceError(f"tokenizer {tokenizer} does not exist; pass a sentencepiece .model file or an "
                                 f"HF tokenizer directory")
        tok = load_tokenizer(path) if path and os.path.exists(path) else None
        engine = cls(model, tok, **kwargs)
        engine.checkpoint, engine.meta = loaded.checkpoint, loaded.meta
        return engine

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: Optional[SamplingParams] = None) -> int:
        """Queue a prompt (text, or token ids); returns the request id."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InferenceError("this model has no tokenizer (the run's data.tokenizer file is missing); "
                                     "pass token ids or a tokenizer")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        self.model.check_tokens(torch.tensor(ids, dtype=torch.long, device="cpu")[None] if ids
                                else torch.zeros(1, 0, device="cpu"),
                                bounded=not self.unbounded)
        eos = getattr(self.tokenizer, "eos_id", None)
        req = _Request(self._next_id, ids, params, StopChecker(params, eos), make_generator(params))
        self._next_id += 1
        self.waiting.append(req)
        return req.id

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """Admit, decode one token for every running request, finish; returns this step's events."""
        events = self._admit()
        if self.running:
            events += self._decode()
        self.stats["max_running"] = max(self.stats["max_running"], len(self.running))
        return events

    def _admit(self) -> list[Event]:
        events = []
        while self.waiting and len(self.running) < self.max_batch:
            if self.running and self._free_pages() <= self._blocked_free:
                break  # nothing was freed since the head of the queue last failed to fit (or was preempted)
            group = self._prefill_group()
            try:
                logits = self._prefill(group)
            except OutOfPages as e:  # only a group of one: the others join only when they surely fit
                req = group[0]
                if self.running:
                    self._blocked_free = self._free_pages()
                    break
                self.waiting.popleft()
                events.append(self._fail(req, f"the prompt ({len(req.prompt)} tokens) does not fit in the KV "
                                              f"budget even alone ({e}); raise kv_bytes or shorten the prompt"))
                continue
            self._blocked_free = -1
            new = []
            for req, out in zip(group, logits):
                self.waiting.popleft()
                self._insert(self.running, req)
                req.cached = len(self._fed(req))
                if req.tokens:  # recomputed: its next token is known, nothing is sampled
                    self.stats["recomputed_tokens"] += req.cached - len(req.prompt)
                else:
                    new.append((req, out[-1]))
            if new:
                tokens = self._sample(torch.stack([last for _, last in new]), [req for req, _ in new])
                events += [self._accept(req, token) for (req, _), token in zip(new, tokens.tolist())]
        return events

    def _fed(self, req: _Request) -> list[int]:
        """The tokens a request's prefill writes: its prompt, plus, for a preempted request recomputed in one
        prefill, the generated tokens its cache held (else those are replayed by decode steps)."""
        return req.prompt + (req.tokens[:-1] if self.cache.prefill_equals_decode else [])

    def _prefill_group(self) -> list[_Request]:
        """The head of the queue, and the requests behind it that surely fit beside it (every row of each
        holding its whole prompt, the most a prefill takes), within ``max_batch`` and ``max_prefill_tokens``."""
        head = self.waiting[0]
        group, tokens = [head], len(self._fed(head))
        bound, free = self.cache.prefill_pages_bound(tokens), self._free_pages()
        if self.cache.prefill_chunk is not None or bound > free:
            return group
        for req in list(self.waiting)[1:]:
            n = len(self._fed(req))
            more = self.cache.prefill_pages_bound(n)
            if (len(self.running) + len(group) >= self.max_batch or bound + more > free
                    or (self.max_prefill_tokens is not None and tokens + n > self.max_prefill_tokens)):
                break
            group.append(req)
            tokens, bound = tokens + n, bound + more
        return group

    def _prefill(self, group: list[_Request]) -> list[torch.Tensor]:
        """Prefill ``group`` in one forward; the logits ``[1, V]`` of each one's last token. On OutOfPages the
        group's rows are released and it is raised."""
        fed = [torch.tensor(self._fed(req), device=self.device) for req in group]
        if self.model.group is not None:  # no rank may run out alone inside the forward: all decide on the bound
            bound, free = sum(self.cache.prefill_pages_bound(len(f)) for f in fed), self._free_pages()
            if bound > free:
                raise OutOfPages(f"{bound} pages may be needed, {free} free on some rank")
        for req in group:
            self.cache.add(req.id, req.params.max_new_tokens)
        start = time.perf_counter()
        try:
            logits = self.model.prefill_batch(self.cache, [req.id for req in group], fed, last_only=True)
        except OutOfPages:
            for req in group:
                self.cache.release(req.id)
            raise
        self.stats["prefill_s"] += time.perf_counter() - start
        self.stats["prefill_tokens"] += sum(len(f) for f in fed)
        self.stats["prefill_batches"] += 1
        return logits

    def _reserve(self) -> list[Event]:
        """Reserve the pages this decode step can take, oldest request first. A request that does not find
        them preempts the newest running ones until it does; the newest left waits itself; the oldest,
        with the pool to itself, fails."""
        events, reserved, i = [], 0, 0
        needed = self._most_on_any_rank(self.cache.decode_pages_needed([r.id for r in self.running]))
        if sum(needed) <= self._free_pages():  # every request finds its pages: nothing to preempt
            return events
        needs = dict(zip([r.id for r in self.running], needed))
        while i < len(self.running):
            req = self.running[i]
            while needs[req.id] > self._free_pages() - reserved and self.running[-1] is not req:
                self._preempt(self.running[-1])
            if needs[req.id] <= self._free_pages() - reserved:
                reserved += needs[req.id]
                i += 1
            elif i > 0:
                self._preempt(req)
            else:
                events.append(self._fail(req, f"the request needs {needs[req.id]} more KV pages after "
                                              f"{len(req.prompt)} prompt + {len(req.tokens)} generated tokens and "
                                              f"only {self._free_pages()} of {self.pool.num_pages} are free "
                                              f"with nothing else running; raise kv_bytes or lower max_new_tokens"))
        return events

    def _preempt(self, req: _Request) -> None:
        """Give a running request's pages back and queue it (in arrival order) to be recomputed."""
        self.cache.release(req.id)
        self.running.remove(req)
        req.cached = 0
        req.preemptions += 1
        self.stats["preemptions"] += 1
        self._insert(self.waiting, req)

    @staticmethod
    def _insert(queue, req: _Request) -> None:
        """Insert ``req`` into ``queue`` (the running list or the waiting queue, both in arrival order)."""
        queue.insert(bisect.bisect([r.id for r in queue], req.id), req)

    def _decode(self) -> list[Event]:
        preempted = self.stats["preemptions"]
        events = self._reserve()
        if not self.running:
            return events
        batch = list(self.running)
        tokens = torch.tensor([r.next_token for r in batch], device=self.device)
        positions = torch.tensor([r.cached for r in batch], device=self.device)
        sampled = [i for i, r in enumerate(batch) if not r.replaying]
        start = time.perf_counter()
        logits = self.model.decode(self.cache, [r.id for r in batch], tokens, positions)
        self.stats["decode_s"] += time.perf_counter() - start
        self.stats["decode_tokens"] += len(sampled)
        self.stats["recomputed_tokens"] += len(batch) - len(sampled)
        for req in batch:
            req.cached += 1
        if len(sampled) < len(batch):  # some requests replay a recompute: only the others sample
            logits = logits[sampled]
        new = self._sample(logits, [batch[i] for i in sampled]) if sampled else torch.empty(0, device="cpu")
        for i, token in zip(sampled, new.tolist()):
            events.append(self._accept(batch[i], token))
        if self.stats["preemptions"] > preempted and self.running:
            self._blocked_free = self._free_pages()  # the preempted wait until a request ends
        return events

    def _sample(self, logits: torch.Tensor, requests: list[_Request]) -> torch.Tensor:
        if logits.shape[1] > self.vocab_limit:  # ids past the tokenizer's are never sampled
            logits = logits[:, : self.vocab_limit]
        tokens = sample(logits, [r.params for r in requests], [r.generator for r in requests])
        return self.model.same_on_all_ranks(tokens)

    # Tensor parallelism: every rank's cache holds its own KV heads' rows, and a DMC head compresses as it does,
    # so ranks hold different numbers of pages; the scheduling decisions (admit, reserve, preempt) are taken on
    # the fewest free pages and the most pages needed over the ranks, hence the same on every rank.
    def _free_pages(self) -> int:
        """Free pages in the pool (under tensor parallelism: the fewest on any rank)."""
        return -int(self._most_on_any_rank([-len(self.pool.free_pages)])[0])

    def _most_on_any_rank(self, counts: Sequence[int]) -> list[int]:
        """Elementwise maximum of ``counts`` over the tensor-parallel ranks (``counts`` without a group)."""
        if self.model.group is None:
            return list(counts)
        t = torch.tensor(list(counts), dtype=torch.long, device="cpu")  # gloo: host tensors
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.model.group)
        return t.tolist()

    def _accept(self, req: _Request, token: int) -> Event:
        """Append a sampled token; finish the request if it stops here. The output is detokenised now when stop
        strings are looked for in it; else only when the request finishes or an event's text is read
        (:meth:`_event_text`), so a step does not decode every running request's whole output for nobody."""
        req.tokens.append(token)
        eager = self.tokenizer is None or bool(req.params.stop)
        if eager:
            self._decode_text(req)
        done, reason, text = req.stop.check(token, req.text)
        if eager:
            req.text = text  # cut before a stop string that finished it
        if not done and not self.unbounded and req.position + 1 >= self.model.shape.max_positions:
            done, reason = True, "max_positions"
        if done:
            self._finish(req, reason)
        if eager:
            return Event(req.id, token, self._new_text(req, req.text, done), done, reason)
        n = len(req.tokens)
        return Event(req.id, token, lambda: self._event_text(req, n, done), done, reason)

    def _decode_text(self, req: _Request) -> None:
        """``req.text``: its generated tokens decoded ("" without a tokenizer)."""
        req.text = self.tokenizer.decode(req.tokens) if self.tokenizer is not None else ""
        req.text_tokens = len(req.tokens)

    def _event_text(self, req: _Request, n: int, done: bool) -> str:
        """The text the event of ``req``'s ``n``-th generated token streams (``done``: its last). What an event
        streams depends on what the ones before it streamed, so those are computed first, in order, each from the
        tokens up to its own: the texts an eager decode at every token would have sent."""
        while len(req.stream_texts) < n:
            j = len(req.stream_texts) + 1
            text = req.text if req.text_tokens == j else self.tokenizer.decode(req.tokens[:j])
            req.stream_texts.append(self._new_text(req, text, done and j == n))
        return req.stream_texts[n - 1]

    @staticmethod
    def _new_text(req: _Request, text: str, done: bool) -> str:
        """What to stream now that the output reads ``text``: held back while it ends inside a multi-byte
        character (U+FFFD)."""
        if (not done and text.endswith("\ufffd")) or not text.startswith(req.streamed):
            return ""
        new, req.streamed = text[len(req.streamed):], text
        return new

    def _finish(self, req: _Request, reason: Optional[str], error: Optional[str] = None) -> None:
        if req.text_tokens != len(req.tokens):  # not decoded since its last token (no stop strings)
            self._decode_text(req)
        out = Output(req.id, req.prompt, req.tokens, req.text, reason, error, preemptions=req.preemptions)
        if req.id in self.cache.rows:
            entries = self.cache.entries(req.id)
            tokens = len(req.prompt) + len(req.tokens) - 1  # written into the cache (the last one never fed)
            out.entries = entries.tolist()
            out.compression = {"overall": tokens * entries.numel() / max(int(entries.sum()), 1),
                               "per_layer": (tokens * entries.shape[1] / entries.sum(1).clamp(min=1)).tolist(),
                               "tokens": tokens}
            out.kv_bytes = self.cache.bytes_held(req.id)
            self.cache.release(req.id)
        if req in self.running:
            self.running.remove(req)
        self.finished[req.id] = out

    def _fail(self, req: _Request, message: str) -> Event:
        self._finish(req, "error", message)
        return Event(req.id, None, "", True, "error", message)

    # -- conveniences -----------------------------------------------------------------------------
    def stream(self, prompts: Sequence[str | Sequence[int]],
               params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[Event]:
        """Queue ``prompts`` and yield events until all of them (and earlier requests) are done."""
        for prompt, p in zip(prompts, _per_prompt(params, len(prompts))):
            self.add_request(prompt, p)
        yield from self.run()

    def run(self) -> Iterator[Event]:
        """Step until every queued request is done, yielding the events."""
        while self.has_work():
            yield from self.step()

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Output]:
        """Run ``prompts`` to completion; their :class:`Output` in prompt order."""
        first = self._next_id
        for _ in self.stream(prompts, params):
            pass
        return [self.finished.pop(i) for i in range(first, first + len(prompts))]

    def memory(self) -> dict:
        """The pool now and at peak (bytes), and the per-row state of running requests."""
        return {**self.pool.nbytes(), "page_bytes": self.pool.page_bytes, "pages": self.pool.num_pages,
                "running_state": sum(self.cache.state_bytes(r.id) for r in self.running)}


def _per_prompt(params, n: int) -> list[Optional[SamplingParams]]:
    if params is None or isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise InferenceError(f"{len(params)} sampling params for {n} prompts; give one, or one per prompt")
    return list(params)


def summarize(outputs: Sequence[Output]) -> dict:
    """Totals over finished requests: tokens written to the cache, entries held at the end, the
    achieved compression overall and per layer (tokens / entries, over requests and KV heads)."""
    done = [o for o in outputs if o.entries is not None]
    if not done:
        return {"requests": len(outputs), "failed": sum(o.error is not None for o in outputs)}
    entries = torch.stack([torch.tensor(o.entries, dtype=torch.float64) for o in done])  # [R, L, H_kv]
    tokens = torch.tensor([o.compression["tokens"] for o in done], dtype=torch.float64)
    heads = entries.shape[2]
    per_layer = (tokens.sum() * heads / entries.sum((0, 2))).tolist()
    return {"requests": len(outputs), "failed": sum(o.error is not None for o in outputs),
            "generated_tokens": sum(len(o.tokens) for o in outputs), "cached_tokens": int(tokens.sum()),
            "compression": float(tokens.sum() * entries[0].numel() / entries.sum()), "per_layer": per_layer,
            "kv_bytes_at_end": sum(o.kv_bytes.get("total", 0) for o in done)}
