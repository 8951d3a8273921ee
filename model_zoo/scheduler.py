"""Continuous batching for any Backend: requests share one KV cache of `max_batch` slots, each decoding in the
running batch from the step after its prefill until it ends.

One thread owns the backend. Each turn of its loop: drop cancelled requests (their slots free at once), give
waiting requests the lowest free slots (a cache decodes as the smallest graph covering its highest busy row),
prefill at most `prefill_chunk` prompt tokens (a long prompt over several turns, so the running rows keep
decoding), sample the first token of each finished prefill with the request's own sampling parameters and join it
to the decode pipe, keep `pipe.depth` steps in flight, and read the oldest one: detokenize, check stops, finish.

Results come back a step or two late, so a finished row may still decode in steps already launched: their tokens
go to no one (each step remembers which request held each row at launch), and a row leaves the pipe as soon as it
has been launched for its whole token budget, so it never writes past its slot.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from model_zoo.backend import check_token_ids, make_sampler
from model_zoo.decode_pipe import open_pipe
from model_zoo.errors import ConfigError, DeviceError, PromptError
from model_zoo.sampling import SamplingConfig
from model_zoo.text_stream import TextStream
from model_zoo.ticket import GenRequest, Overloaded, Ticket, Unavailable


# prompt lengths a warm-up prefills (and a whole chunk): the GPU engine's prefill GEMMs change kernels with the
# tokens they take (a GEMV up to 16, batched GEMVs to 64, tensor-core GEMMs beyond), one kernel file each
WARM_LENGTHS = (8, 24, 48, 96)


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 8  # KV-cache slots: requests decoding at once
    max_context: int = 2048  # positions per slot (prompt + reply)
    max_queue: int = 256  # requests waiting for a slot; one more is refused (Overloaded)
    prefill_chunk: int = 512  # prompt tokens prefilled per turn at most: long prompts interleave with decoding

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_context", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise ConfigError(f"max-queue must be >= 0, got {self.max_queue}")


class Observer(Protocol):
    """What the scheduler reports, for metrics (the server's Prometheus counters)."""

    def first_token(self, seconds: float) -> None: ...
    def token_gaps(self, seconds: Sequence[float]) -> None: ...
    def finished(self, ticket: Ticket) -> None: ...
    def load(self, running: int, waiting: int) -> None: ...


class _NoObserver:
    def first_token(self, seconds: float) -> None: pass
    def token_gaps(self, seconds: Sequence[float]) -> None: pass
    def finished(self, ticket: Ticket) -> None: pass
    def load(self, running: int, waiting: int) -> None: pass


class _Seq:
    """The scheduler's side of a ticket: its slot, prefill progress, text stream and decode steps launched."""

    def __init__(self, ticket: Ticket, tokenizer: Any, budget: int):
        req = ticket.request
        self.ticket, self.budget = ticket, budget
        self.slot = -1
        self.prefilled = 0  # prompt tokens in the cache
        self.launched = 0  # decode steps launched with this row
        self.last_token_at = 0.0
        self.stream = TextStream(tokenizer, budget, req.stop, req.stop_at_eos, on_text=ticket._add_text)


def open_cache(backend: Any, batch: int, positions: int) -> Any:
    """The backend's KV cache of batch x positions; a DeviceError that says what would fit if it does not."""
    try:
        return backend.new_cache(batch, positions)
    except (DeviceError, torch.cuda.OutOfMemoryError) as e:
        per_position = getattr(backend, "kv_position_bytes", None)
        if per_position is None or not torch.cuda.is_available():
            raise DeviceError(str(e)) from None
        free, unit = torch.cuda.mem_get_info(backend.device)[0], per_position()
        rows, span = free // ((positions + 1) * unit), free // (batch * unit) - 1
        raise DeviceError(f"{e} (about {rows} slots of {positions:,} positions fit, or {batch} slots of "
                          f"{max(span, 0):,} positions: lower --max-batch or --max-context)") from None


class Scheduler:
    """submit(GenRequest) -> Ticket; the decoding runs in the scheduler's own thread (start / close)."""

    def __init__(self, backend: Any, tokenizer: Any, cfg: SchedulerConfig, observer: Observer | None = None,
                 on_progress: Callable[[list[Ticket]], None] | None = None,
                 thread_hooks: tuple[Callable[[], Any], Callable[[], Any]] | None = None):
        """on_progress(tickets): from the scheduler's thread, once a turn, the tickets that moved. thread_hooks:
        (enter, exit) run in the scheduler's thread around its loop (a GPU library's per-thread context)."""
        limit = backend.config.max_positions
        if cfg.max_context > limit:
            raise ConfigError(f"--max-context {cfg.max_context} is beyond the model's context of {limit} tokens")
        self.backend, self.tokenizer, self.cfg = backend, tokenizer, cfg
        self.observer = observer or _NoObserver()
        self.on_progress, self.thread_hooks = on_progress, thread_hooks
        self.cache = open_cache(backend, cfg.max_batch, cfg.max_context)
        self.sampler = make_sampler(backend, SamplingConfig(temperature=0.0), cfg.max_batch)
        self.pipe = open_pipe(backend, self.cache, self.sampler)
        self._free = list(range(cfg.max_batch))  # a heap: the lowest free slot first
        self._waiting: deque[_Seq] = deque()
        self._prefilling: list[_Seq] = []
        self._running: dict[int, _Seq] = {}  # slot -> its sequence, while it decodes
        self._inflight: deque[tuple[Any, dict[int, _Seq]]] = deque()  # (launched step, its rows' sequences)
        self._cancelled: list[Ticket] = []
        self._seqs: dict[int, _Seq] = {}  # ticket number -> sequence, until it ends
        self._numbers = itertools.count(1)
        self._cv = threading.Condition()
        self._closing = False
        self._touched: set[Ticket] = set()
        self.warm_up_s: float | None = None  # the warm-up's seconds, once it has run (GPU backends)
        self.warm_up_error: BaseException | None = None  # why it stopped early (graphs are then captured on use)
        self._thread = threading.Thread(target=self._run, name="fllama-scheduler", daemon=True)

    # -- the callers' side ----------------------------------------------------------------------------------
    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread; requests still open end with an error."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closing

    def submit(self, request: GenRequest) -> Ticket:
        """Queue a request: PromptError / ConfigError for one that cannot run, Overloaded when the queue is full,
        Unavailable once the scheduler has stopped."""
        budget = self.check(request)
        with self._cv:
            if not self.alive:
                raise Unavailable("the server is not taking requests (shutting down or failed)")
            if len(self._waiting) - len(self._free) >= self.cfg.max_queue:  # this one would wait beyond the queue
                raise Overloaded(f"{len(self._waiting)} requests are waiting for a slot already: try again later")
            ticket = Ticket(next(self._numbers), request, self)
            seq = self._seqs[ticket.number] = _Seq(ticket, self.tokenizer, budget)
            self._waiting.append(seq)
            self._cv.notify_all()
        return ticket

    def check(self, request: GenRequest) -> int:
        """The request's token budget, or the error that refuses it."""
        p, ctx = len(request.prompt), self.cfg.max_context
        if p == 0:
            raise PromptError("the prompt is empty")
        check_token_ids(torch.as_tensor(request.prompt, dtype=torch.long), self.backend.config.vocab_size,
                        "the prompt")
        if p >= ctx:
            raise PromptError(f"the prompt has {p} tokens but the context holds {ctx} (prompt and reply): shorten it")
        if request.max_tokens is not None and p + request.max_tokens > ctx:
            raise PromptError(f"the prompt has {p} tokens and max_tokens asks for {request.max_tokens}, but the "
                              f"context holds {ctx} (prompt and reply): lower max_tokens to {ctx - p} or less")
        check_config = getattr(self.sampler, "check_config", None)
        if check_config is not None:
            check_config(request.sampling)  # what this backend's sampler cannot do
        return request.max_tokens if request.max_tokens is not None else ctx - p

    def cancel(self, ticket: Ticket) -> None:
        with self._cv:
            if not ticket.done:
                self._cancelled.append(ticket)
                self._cv.notify_all()

    @property
    def warming_up(self) -> bool:
        """Until the thread's warm-up has run, where the pipe has one (the GPU engine's)."""
        return self.warm_up_s is None and hasattr(self.pipe, "warm_up")

    def load(self) -> dict:
        """Slots and queue now (approximate: read without the scheduler's lock)."""
        running = len(self._running) + len(self._prefilling)
        return {"max_batch": self.cfg.max_batch, "running": running, "waiting": len(self._waiting),
                "free_slots": len(self._free), "max_context": self.cfg.max_context, "warming_up": self.warming_up}

    # -- the scheduler's thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        entered = False
        try:
            if self.thread_hooks is not None:
                self.thread_hooks[0]()
                entered = True
            self._warm_up()
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._closing or self._has_work())
                    if self._closing:
                        break
                    cancelled, self._cancelled = self._cancelled, []
                    self._admit()
                try:
                    for t in cancelled:
                        self._drop(t)
                    self._turn()
                except Exception as e:  # noqa: BLE001 - a failure here fails the batch's requests, not the server
                    self._fail_decoding(e)
                self._report()
        finally:
            self._closing = True
            self._fail_open(Unavailable("the server stopped before this request finished"))
            if entered:
                self.thread_hooks[1]()

    def _warm_up(self) -> None:
        """Before the first request, where the pipe captures graphs (the GPU engine): prefills of WARM_LENGTHS
        tokens and a whole chunk (each size class of the prefill kernels) and a first-token draw load their kernels
        (on a machine that has not built them yet, compile them: seconds, then cached), and the pipe captures every
        decode graph the slots may need. Requests that come meanwhile wait in the queue. A failure is kept in
        warm_up_error, and whatever is missing is then made on first use, as without a warm-up."""
        capture = getattr(self.pipe, "warm_up", None)
        if capture is None:
            return
        t0, ctx = time.perf_counter(), self.cfg.max_context
        try:
            for n in sorted({min(n, self.cfg.prefill_chunk, ctx - 1) for n in (*WARM_LENGTHS, ctx)} - {0}):
                self.pipe.set_length(0, 0)
                ids = torch.zeros((1, n), dtype=torch.long, device=self.backend.device)
                logits = self.backend.forward(ids, self.cache, torch.tensor([0]), last=True)  # [1, 1, V]
                self.sampler.sample(logits[:, -1], [0])  # row 0's state is set afresh by its first request
            self.pipe.set_length(0, 0)
            capture()
        except Exception as e:  # noqa: BLE001 - a server without a warm-up still serves
            self.warm_up_error = e
            self.pipe = open_pipe(self.backend, self.cache, self.sampler)
        self.warm_up_s = time.perf_counter() - t0

    def _has_work(self) -> bool:
        return bool(self._cancelled or self._waiting or self._prefilling or self._running or self._inflight)

    def _admit(self) -> None:
        """Waiting requests into the lowest free slots (under the lock)."""
        while self._waiting and self._free:
            seq = self._waiting.popleft()
            seq.slot = seq.ticket.slot = heapq.heappop(self._free)
            self._prefilling.append(seq)

    def _turn(self) -> None:
        """One prefill chunk, the first tokens of finished prefills, launches up to the depth, one step read."""
        ready = self._prefill()
        if ready:
            self._start_decoding(ready)
        try:
            while self.pipe.rows and len(self._inflight) < self.pipe.depth:
                self._launch()
            if self._inflight and (len(self._inflight) >= self.pipe.depth or not self.pipe.rows):
                self._consume()
        except Exception as e:  # noqa: BLE001 - a failed step fails its rows, never the server
            self._fail_decoding(e)

    def _prefill(self) -> list[tuple[_Seq, torch.Tensor]]:
        """Up to prefill_chunk prompt tokens into their slots, chunks of one length in one forward call: the
        sequences whose prompt is now complete, with the logits of its last position [1, V]."""
        budget, plan = self.cfg.prefill_chunk, {}
        for seq in self._prefilling:
            if budget <= 0:
                break
            n = min(len(seq.ticket.request.prompt) - seq.prefilled, budget)
            plan.setdefault(n, []).append(seq)
            budget -= n
        ready: list[tuple[_Seq, torch.Tensor]] = []
        for n, seqs in plan.items():
            self._prefill_group(n, seqs, ready)
        return ready

    def _prefill_group(self, n: int, seqs: list[_Seq], ready: list) -> None:
        try:
            for seq in seqs:
                if seq.prefilled == 0:
                    self.pipe.set_length(seq.slot, 0)  # the slot's previous positions are overwritten
            chunk = torch.tensor([seq.ticket.request.prompt[seq.prefilled:seq.prefilled + n] for seq in seqs],
                                 device=self.backend.device)  # [g, n]
            slots = torch.tensor([s.slot for s in seqs])
            logits = self.backend.forward(chunk, self.cache, slots, last=True)  # [g, 1, V]
        except Exception as e:  # noqa: BLE001 - these requests fail (alone, if a group failed), the others go on
            if len(seqs) > 1:
                for seq in seqs:
                    seq.prefilled = 0  # its row is opened again
                    self._prefill_group(n, [seq], ready)
                return
            self._end(seqs[0], "error", e)
            return
        for i, seq in enumerate(seqs):
            seq.prefilled += n
            if seq.prefilled == len(seq.ticket.request.prompt):
                self._prefilling.remove(seq)
                ready.append((seq, logits[i:i + 1, -1]))

    def _start_decoding(self, ready: list[tuple[_Seq, torch.Tensor]]) -> None:
        """Sample each finished prefill's first token (one host wait for all), then join the decoding rows."""
        seqs = [s for s, _ in ready]
        try:
            for seq in seqs:
                self._arm_row(seq)
            first = self.sampler.sample(torch.cat([lg for _, lg in ready]), [s.slot for s in seqs]).tolist()
        except Exception as e:  # noqa: BLE001
            for seq in seqs:
                self._end(seq, "error", e)
            return
        now = time.perf_counter()
        for seq, token in zip(seqs, first):
            seq.ticket.first_token_at = seq.last_token_at = now
            self.observer.first_token(now - seq.ticket.submitted)
            if self._push(seq, token):
                continue
            self._running[seq.slot] = seq
            self.pipe.join(seq.slot, token, len(seq.ticket.request.prompt))

    def _arm_row(self, seq: _Seq) -> None:
        """The slot's sampling state for its new sequence: the request's parameters and seed, its prompt seen. Set
        just before the first token, in the turn the row joins: a decode graph samples every row it covers, so
        steps launched while a long prompt was prefilling have drawn for this row too."""
        configure = getattr(self.sampler, "configure_row", None)
        if configure is not None:
            configure(seq.slot, seq.ticket.request.sampling)
        self.sampler.observe(seq.slot, list(seq.ticket.request.prompt))

    def _launch(self) -> None:
        step = self.pipe.launch()
        rows = {r: self._running[r] for r in step.rows}
        self._inflight.append((step, rows))
        for r, seq in rows.items():
            seq.launched += 1
            if seq.launched >= seq.budget - 1:  # its last token is on the way: never decode past the budget
                self.pipe.leave(r)

    def _consume(self) -> None:
        step, rows = self._inflight.popleft()
        tokens = step.tokens()
        now, gaps = time.perf_counter(), []
        for r, token in zip(step.rows, tokens):
            seq = rows[r]
            if seq.stream.done or seq.ticket.done:
                continue  # decoded after its end (or cancelled): the token goes to no one
            gaps.append(now - seq.last_token_at)
            seq.last_token_at = now
            self._push(seq, token)
        self.observer.token_gaps(gaps)

    def _push(self, seq: _Seq, token: int) -> bool:
        """The sequence's next token; True when it has ended (then its slot is free)."""
        self._touched.add(seq.ticket)
        try:
            done = seq.stream.push(token)
        except Exception as e:  # noqa: BLE001 - a token its tokenizer cannot decode ends this request only
            self._end(seq, "error", e)
            return True
        if done:
            self._end(seq, seq.stream.finish_reason)
        return done

    def _drop(self, ticket: Ticket) -> None:
        """A cancelled request leaves at once: out of the queue, the prefill or the decoding rows."""
        seq = self._seqs.get(ticket.number)
        if seq is None or ticket.done:
            return
        with self._cv:
            if seq in self._waiting:
                self._waiting.remove(seq)
        self._end(seq, "cancelled")

    def _end(self, seq: _Seq, reason: str | None, error: BaseException | None = None) -> None:
        """Finish the ticket and free its slot (its row leaves the pipe; steps in flight decode it for no one)."""
        if self._running.get(seq.slot) is seq:
            del self._running[seq.slot]
            self.pipe.leave(seq.slot)
        if seq in self._prefilling:
            self._prefilling.remove(seq)
        if seq.slot >= 0:
            with self._cv:
                heapq.heappush(self._free, seq.slot)
            seq.slot = seq.ticket.slot = -1
        st = seq.stream
        seq.ticket._finish(reason or "length", st.tokens, st.text, st.generated, error)
        self._seqs.pop(seq.ticket.number, None)
        self._touched.add(seq.ticket)
        self.observer.finished(seq.ticket)

    def _fail_decoding(self, error: BaseException) -> None:
        """A decode step (or the turn) failed: every request holding a slot ends with the error, and a fresh pipe
        takes over."""
        for seq in [*self._running.values(), *self._prefilling]:
            self._end(seq, "error", error)
        self._inflight.clear()
        self.pipe = open_pipe(self.backend, self.cache, self.sampler)

    def _fail_open(self, error: BaseException) -> None:
        with self._cv:
            seqs = list(self._seqs.values())
        for seq in seqs:
            try:
                self._end(seq, "error", error)
            except Exception:  # noqa: BLE001 - closing: the ticket must end even if the pipe cannot
                seq.ticket._finish("error", error=error)
        self._report()

    def _report(self) -> None:
        self.observer.load(len(self._running) + len(self._prefilling), len(self._waiting))
        if self._touched:
            touched, self._touched = list(self._touched), set()
            if self.on_progress is not None:
                self.on_progress(touched)
