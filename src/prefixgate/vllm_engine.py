"""The vLLM adapter: an in-process ``AsyncLLMEngine`` behind prefixgate's :class:`Engine`.

Works on vLLM 0.26 through 0.32 through their public surface only: ``generate`` with a
``TokensPrompt`` (so the prompt is tokenized once, by us, with the engine's own tokenizer),
``abort``, ``get_tokenizer``, ``vllm_config`` and a ``StatLoggerBase`` factory for per-step KV
stats. Engine exceptions are translated here into prefixgate's error types.

A multimodal request's media (URLs or encoded bytes) are loaded here with vLLM's own
``MediaConnector``, as vLLM's chat path loads them, and given to vLLM as ``multi_modal_data``
beside the token ids: vLLM's processor expands the placeholders the chat template rendered and
hashes the media for its prefix cache itself. A text-only model takes no media: vLLM fails such
a request (an opaque ``EngineGenerateError`` on 0.32), so it is refused here first with
``InvalidRequest``.

vLLM is imported lazily: importing prefixgate never imports vLLM.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any

from .clock import Clock, MonotonicClock
from .engine import (
    EngineRequest,
    KvStats,
    Media,
    SamplingCheck,
    Tokenizer,
    check_max_tokens,
    read_completion,
)
from .errors import EngineDead, EngineError, InvalidRequest, Overloaded, PrefixgateError, Reason

if TYPE_CHECKING:  # pragma: no cover
    from vllm import AsyncEngineArgs

__all__ = ["VllmEngine", "load_media", "stat_logger_factory", "tokens_prompt"]

log = logging.getLogger(__name__)


async def load_media(media: tuple[Media, ...], connector: Any = None) -> dict[str, list[Any]]:
    """vLLM's ``multi_modal_data`` for ``media``: each item loaded by vLLM's ``MediaConnector``
    (``fetch_image_async`` and the like; encoded bytes as a ``data:`` URL), by modality, in order.

    Raises:
        InvalidRequest: If an item cannot be fetched or decoded.
    """
    import base64

    if connector is None:
        from vllm.multimodal.media.connector import MediaConnector

        connector = MediaConnector()
    data: dict[str, list[Any]] = {}
    for i, item in enumerate(media):
        url = item.data
        if isinstance(url, bytes):
            url = f"data:application/octet-stream;base64,{base64.b64encode(url).decode('ascii')}"
        try:
            loaded = await getattr(connector, f"fetch_{item.modality}_async")(url)
        except Exception as e:  # network errors, undecodable data, unsupported URLs
            raise InvalidRequest(f"could not load media item {i} ({item.modality}): "
                                 f"{type(e).__name__}: {e}") from e
        data.setdefault(item.modality, []).append(loaded)
    return data


def tokens_prompt(request: EngineRequest, multi_modal_data: Mapping[str, list[Any]] | None = None
                  ) -> dict[str, Any]:
    """vLLM's ``TokensPrompt`` for ``request``: token ids, cache salt and, for a multimodal
    request, ``multi_modal_data`` (from :func:`load_media`)."""
    prompt: dict[str, Any] = {"prompt_token_ids": list(request.prompt_token_ids)}
    if multi_modal_data:
        prompt["multi_modal_data"] = dict(multi_modal_data)
    if request.cache_salt is not None:
        prompt["cache_salt"] = request.cache_salt
    return prompt


class _KvStatsFeed:
    """Accumulates vLLM's per-step scheduler stats into one :class:`KvStats`.

    vLLM reports prefix-cache queries/hits and preemptions *per interval*; this sums them.
    ``record`` runs in the engine's output-handler task, on the same event loop as the gateway.
    """

    def __init__(self, total_blocks: int, clock: Clock) -> None:
        self.total_blocks = total_blocks
        self.clock = clock
        self.latest: KvStats | None = None
        self.queries = self.hits = self.preemptions = self.steps = 0

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if iteration_stats is not None:
            self.preemptions += getattr(iteration_stats, "num_preempted_reqs", 0) or 0
        if scheduler_stats is None:
            return
        pcs = getattr(scheduler_stats, "prefix_cache_stats", None)
        if pcs is not None:
            self.queries += pcs.queries
            self.hits += pcs.hits
        self.steps += 1
        usage = min(1.0, max(0.0, float(scheduler_stats.kv_cache_usage)))
        self.latest = KvStats(
            time=self.clock.now(),
            total_blocks=self.total_blocks,
            free_blocks=round((1.0 - usage) * self.total_blocks),
            running=scheduler_stats.num_running_reqs,
            waiting=scheduler_stats.num_waiting_reqs,
            prefix_queries=self.queries,
            prefix_hits=self.hits,
            preemptions=self.preemptions,
            steps=self.steps,
        )

    def logger_factory(self) -> Any:
        """A ``StatLoggerFactory`` for ``AsyncLLMEngine.from_engine_args(stat_loggers=[...])``."""
        return stat_logger_factory(self.record)


def stat_logger_factory(record: Callable[[Any, Any], None]) -> Any:
    """vLLM's ``StatLoggerBase`` glue, in one place: a logger class (a ``StatLoggerFactory``, for
    ``AsyncLLMEngine.from_engine_args(stat_loggers=[...])``) whose every per-step report calls
    ``record(scheduler_stats, iteration_stats)``, either of which may be ``None``. It runs in the
    engine's output-handler task, on the caller's event loop.
    """
    from vllm.v1.metrics.loggers import StatLoggerBase

    class PrefixgateStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats: Any, iteration_stats: Any,
                   mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
            record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return PrefixgateStatLogger


class _Live:
    """A request being streamed: its consumer task, and whether it is waiting on vLLM now."""

    __slots__ = ("killed", "task", "waiting")

    def __init__(self, task: asyncio.Task[Any] | None) -> None:
        self.task = task
        self.waiting = False
        self.killed = False


class _ShutDownEngine:
    """Stands in for the vLLM engine after :meth:`VllmEngine.shutdown`: every call fails typed."""

    errored = True

    def __getattr__(self, name: str) -> Any:
        raise EngineDead("the vLLM engine was shut down")


class VllmEngine:
    """Adapts a vLLM ``AsyncLLMEngine`` (``AsyncLLM``) to prefixgate's :class:`Engine`.

    Build it with :meth:`from_engine_args` so KV stats are wired in from the start, or wrap an
    engine you built yourself (stats are then attached to its logger manager when the vLLM
    version allows, else :meth:`kv_stats` stays ``None``).

    Args:
        engine: A running ``AsyncLLMEngine`` with prefix caching on.
        clock: Clock used to timestamp KV stats.
        feed: Internal; set by :meth:`from_engine_args`.

    Raises:
        ValueError: If the engine was built without prefix caching.
    """

    def __init__(self, engine: Any, *, clock: Clock | None = None,
                 feed: _KvStatsFeed | None = None) -> None:
        self._engine = engine
        cfg = engine.vllm_config
        if not cfg.cache_config.enable_prefix_caching:
            raise ValueError("VllmEngine needs an engine built with enable_prefix_caching=True")
        self._block_size = int(cfg.cache_config.block_size)
        # vLLM reserves block 0 as its null block; requests can use the rest.
        self._num_blocks = max(0, int(cfg.cache_config.num_gpu_blocks or 0) - 1)
        self._max_model_len = int(cfg.model_config.max_model_len)
        self._max_num_seqs = int(cfg.scheduler_config.max_num_seqs)
        self._step_tokens = int(cfg.scheduler_config.max_num_batched_tokens)
        self._model_name = str(cfg.model_config.served_model_name or cfg.model_config.model)
        self._multimodal = bool(getattr(cfg.model_config, "is_multimodal_model", False))
        self._connector: Any = None
        self._tokenizer: Tokenizer = engine.get_tokenizer()
        self._feed = feed or _KvStatsFeed(self._num_blocks, clock or MonotonicClock())
        self._consumers: dict[str, _Live] = {}  # request id -> the task streaming it
        self._shut_down = False
        if feed is None:
            self._attach_feed()

    @classmethod
    def from_engine_args(cls, engine_args: AsyncEngineArgs, *,
                         clock: Clock | None = None) -> VllmEngine:
        """Starts an ``AsyncLLMEngine`` with prefixgate's stat logger and wraps it.

        Prefix caching is switched on if the arguments leave it unset.

        Args:
            engine_args: vLLM's engine arguments.
            clock: Clock used to timestamp KV stats.
        """
        from vllm import AsyncLLMEngine

        if engine_args.enable_prefix_caching is None:
            engine_args.enable_prefix_caching = True
        feed = _KvStatsFeed(0, clock or MonotonicClock())
        engine = AsyncLLMEngine.from_engine_args(engine_args, stat_loggers=[feed.logger_factory()])
        feed.total_blocks = max(0, int(engine.vllm_config.cache_config.num_gpu_blocks or 0) - 1)
        return cls(engine, clock=clock, feed=feed)

    def _attach_feed(self) -> None:
        # Not a stable vLLM interface: guarded, and harmless when it does not fit.
        try:
            from vllm.v1.metrics.loggers import PerEngineStatLoggerAdapter

            manager = self._engine.logger_manager
            manager.stat_loggers.append(PerEngineStatLoggerAdapter(
                vllm_config=self._engine.vllm_config,
                engine_indexes=manager.engine_indexes,
                per_engine_stat_logger_factory=self._feed.logger_factory(),
            ))
        except Exception as e:
            log.warning("prefixgate: could not attach KV stats to this vLLM engine (%s); build it "
                        "with VllmEngine.from_engine_args for KV-aware admission", e)

    @property
    def vllm_engine(self) -> Any:
        """The wrapped ``AsyncLLMEngine``."""
        return self._engine

    @property
    def healthy(self) -> bool:
        """``False`` once the engine is shut down or vLLM reports it errored (its engine core
        process died: vLLM's client watches it), with no request needed to find out."""
        return not self._shut_down and not self._engine.errored

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def multimodal(self) -> bool:
        """Whether the model takes media (vLLM's ``model_config.is_multimodal_model``)."""
        return self._multimodal

    @property
    def max_num_seqs(self) -> int:
        """The most requests vLLM runs at once (the gateway's default in-flight window)."""
        return self._max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        """The most tokens vLLM schedules in one step (its chunked-prefill budget; sizes the
        gateway's default dispatch pacing)."""
        return self._step_tokens

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def default_sampling_params(self) -> Any:
        from vllm import SamplingParams

        return SamplingParams()

    def build_sampling_params(self, fields: Mapping[str, Any]) -> Any:
        """``vllm.SamplingParams(**fields)``; what its constructor refuses (an unknown field,
        ``max_tokens=0``, a negative temperature, ...) is ``InvalidRequest``."""
        from vllm import SamplingParams

        try:
            return SamplingParams(**fields)
        except Exception as e:  # TypeError, ValueError or vLLM's own validation errors
            raise InvalidRequest(f"invalid sampling parameters: {e}") from None

    def check_sampling_params(self, sampling_params: Any) -> SamplingCheck:
        from vllm import SamplingParams

        if not isinstance(sampling_params, SamplingParams):
            raise InvalidRequest(
                f"sampling_params must be vllm.SamplingParams, not {type(sampling_params).__name__}")
        max_tokens = check_max_tokens(sampling_params.max_tokens)
        skip = getattr(sampling_params, "skip_reading_prefix_cache", None)
        if skip is None:  # vLLM skips the cache when prompt logprobs are requested
            skip = sampling_params.prompt_logprobs is not None
        return SamplingCheck(max_tokens=max_tokens, reads_cache=not skip)

    def kv_stats(self) -> KvStats | None:
        return self._feed.latest

    # Reads a RequestOutput: aborted is finish_reason == "abort"; the token ids are those of a
    # single, cumulative completion. The function itself, not a method wrapping it: it runs for
    # every output.
    completion = staticmethod(read_completion)

    async def generate(self, request: EngineRequest) -> AsyncIterator[Any]:
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        client_error: type[Exception] = ValueError  # vLLM 0.26 raised ValueError
        try:  # vLLM >= 0.27 raises its own client errors
            from vllm.exceptions import VLLMClientError

            client_error = VLLMClientError
        except ImportError:  # pragma: no cover - vLLM 0.26
            pass
        try:  # vLLM's own admission limits (max_num_queued_reqs / _tokens), where it has them
            from vllm.exceptions import MaxQueuedTokensError, QueueOverflowError
            busy: tuple[type[BaseException], ...] = (QueueOverflowError, MaxQueuedTokensError)
        except ImportError:  # pragma: no cover - vLLM 0.26
            busy = ()

        make_input: Callable[..., Any] | None = None
        try:  # vLLM's typed engine input (0.26 and 0.32): not the deprecated raw-prompt path
            from vllm.inputs import tokens_input

            make_input = tokens_input
        except ImportError:  # pragma: no cover - older vLLM
            pass
        prompt: Any
        if request.media:
            prompt = await self._media_prompt(request)
        elif make_input is not None:
            prompt = make_input(list(request.prompt_token_ids), cache_salt=request.cache_salt)
        else:  # pragma: no cover - older vLLM
            prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
            if request.cache_salt is not None:
                prompt["cache_salt"] = request.cache_salt
        started = finished = False
        live = _Live(asyncio.current_task())
        self._consumers[request.request_id] = live
        try:
            outputs = self._engine.generate(
                prompt, request.sampling_params, request.request_id,
                lora_request=request.lora_request, priority=request.priority)
            pull = outputs.__anext__
            while True:
                if self._shut_down:
                    raise EngineDead(f"the vLLM engine was shut down serving {request.request_id}")
                live.waiting = True
                try:
                    out = await pull()
                except StopAsyncIteration:
                    break
                finally:
                    live.waiting = False
                started = True
                finished = bool(out.finished)
                yield out
        except asyncio.CancelledError:
            task = live.task
            if live.killed and task is not None and task.uncancel() == 0:
                raise EngineDead(f"the vLLM engine was shut down serving {request.request_id}") from None
            raise
        except PrefixgateError:
            raise
        except EngineDeadError as e:
            raise EngineDead(f"vLLM engine died serving {request.request_id}") from e
        except busy as e:  # the gateway puts its own wait estimate in retry_after
            raise Overloaded(f"vLLM refused {request.request_id}: {e}", retry_after=1.0,
                             reason=Reason.ENGINE_BUSY) from e
        except (client_error, ValueError, TypeError) as e:
            if started:
                raise EngineError(f"vLLM failed mid-stream on {request.request_id}: {e}") from e
            raise InvalidRequest(f"vLLM refused {request.request_id}: {e}") from e
        except Exception as e:
            raise EngineError(f"vLLM failed on {request.request_id}: {e}") from e
        finally:
            if self._consumers.get(request.request_id) is live:
                del self._consumers[request.request_id]
            if not finished and not self._shut_down and not self._engine.errored:
                await self._engine.abort(request.request_id)

    async def _media_prompt(self, request: EngineRequest) -> Any:
        """The engine input of a multimodal request: its ``TokensPrompt`` with the loaded media,
        through vLLM's renderer (``render_cmpl_async``, which runs the model's processor) where
        vLLM has one, else as the raw prompt dict.

        Raises:
            InvalidRequest: The model is text-only, or a media item cannot be loaded.
        """
        if not self._multimodal:
            raise InvalidRequest(f"{self._model_name} is a text-only model: vLLM takes no media "
                                 f"for it ({len(request.media or ())} item(s) in {request.request_id})")
        if self._connector is None:
            from vllm.multimodal.media.connector import MediaConnector

            self._connector = MediaConnector()
        prompt = tokens_prompt(request, await load_media(request.media or (), self._connector))
        renderer = getattr(self._engine, "renderer", None)
        render = getattr(renderer, "render_cmpl_async", None)
        if render is None:  # pragma: no cover - vLLM before the renderer: the raw prompt dict
            return prompt
        try:
            from vllm.inputs import parse_model_prompt  # type: ignore[attr-defined]
        except ImportError:  # vLLM 0.32 keeps it here
            from vllm.renderers.inputs.preprocess import parse_model_prompt
        try:
            (engine_input,) = await render([parse_model_prompt(self._engine.model_config, prompt)])
        except Exception as e:  # the model's processor refuses the prompt or its media
            raise InvalidRequest(f"vLLM refused {request.request_id}: {type(e).__name__}: {e}") from e
        return engine_input

    async def abort(self, request_id: str) -> None:
        if not self._engine.errored:
            await self._engine.abort(request_id)

    def shutdown(self) -> None:
        """Shuts the wrapped engine down (its worker processes included). Idempotent.

        Requests in flight end at once with :class:`~prefixgate.errors.EngineDead` (vLLM itself
        would leave their streams waiting forever); later requests fail the same way.
        """
        self._shut_down = True
        for live in list(self._consumers.values()):
            if live.waiting and live.task is not None and not live.task.done():
                live.killed = True
                live.task.cancel()
        engine, self._engine = self._engine, _ShutDownEngine()
        if not isinstance(engine, _ShutDownEngine):
            engine.shutdown()
            # Drop vLLM's engine now: collected at interpreter exit, its __del__ raises.
            del engine
            gc.collect()

    def __repr__(self) -> str:
        return (f"VllmEngine(model={self._model_name!r}, block_size={self._block_size}, "
                f"num_blocks={self._num_blocks}, max_model_len={self._max_model_len})")
