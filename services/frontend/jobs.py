"""What the frontend's pipeline passes around, and how a job becomes the worker's messages.

Contract:

- :class:`Job`: a validated, tokenized request ready to route; :class:`Chunk`: one delta
  of its output (the last has ``finish_reason`` and the usage).
- :func:`sampling_proto` is the job's sampling parameters as the worker's protobuf;
  :func:`check_logprobs` raises ApiError 502 when a worker's log-probabilities do not
  match what the job asked; :func:`predicted_cached_tokens` is the router's predicted
  cache hit in the tokens the client's ``cached_tokens`` counts; :data:`FINISH_NAMES`
  maps the worker's finish reasons to OpenAI's.
- :class:`Prior`: a job's first attempt as the express path left it, handed to the
  pipeline's general stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from protos import common_pb2, router_pb2, worker_pb2
from services.frontend import vllm_extras
from services.frontend.images import MmPrompt
from services.frontend.models import ModelInfo
from services.frontend.openai_schema import ApiError, ParsedRequest

if TYPE_CHECKING:  # failures imports handoff, which imports this module
    from services.frontend.failures import WorkerFailure

FINISH_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


@dataclass
class Job:
    """A validated, tokenized request ready to route."""

    request_id: str
    req: ParsedRequest
    model: ModelInfo
    token_ids: list[int]
    created: int
    cache_salt: str = ""  # the tenant's prefix-cache salt ("" = shared/unsalted)
    mm: MmPrompt | None = None  # the images (token_ids then hold their placeholders)


@dataclass
class Chunk:
    """One delta of output. With ``sampling.logprobs`` set, ``logprobs`` holds one entry
    per token of ``token_ids`` (the worker's, checked); with ``prompt_logprobs``, the
    first chunk holds one per prompt token (the first has none: logprob 0, rank 0)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    predicted_cached_tokens: int = 0
    logprobs: list[common_pb2.PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[common_pb2.PositionLogprobs] = field(default_factory=list)


@dataclass(frozen=True)
class Prior:
    """A job's first attempt as the express path (:mod:`.express`) left it, for
    :meth:`Pipeline.stream <services.frontend.pipeline.Pipeline.stream>` to go on from:
    routed to ``route`` as ``mesh_id`` and not run (``failure`` None), or failed
    (``failure``, its ``cause``; its entry released, its calls ended) after the tokens
    ``generated`` went to the client; the request having started at ``started`` and its
    last tokens come at ``last_at`` (monotonic seconds), routed by ``router`` (the
    stub: the next attempts' router too)."""

    mesh_id: str
    route: router_pb2.RouteResponse
    failure: WorkerFailure | None = None
    cause: BaseException | None = None
    generated: tuple[int, ...] = ()
    started: float = 0.0
    last_at: float = 0.0
    router: Any = None


def predicted_cached_tokens(route: router_pb2.RouteResponse, default_block_size: int) -> int:
    """The router's predicted cached prompt tokens for the tokens the client's
    ``cached_tokens`` counts: P's overlap when disaggregated, else the worker's; in blocks
    of ``route.block_size`` (``default_block_size`` for a router that does not send it)."""
    bs = route.block_size or default_block_size
    blocks = (route.predicted_prefill_overlap_blocks if route.disaggregated
              else route.predicted_overlap_blocks)
    return blocks * bs


def sampling_proto(job: Job) -> common_pb2.SamplingParams:
    """The job's sampling parameters as protobuf."""
    s = job.req.sampling
    p = common_pb2.SamplingParams(max_tokens=s.max_tokens or 16, stop=list(s.stop),
                                  stop_token_ids=list(s.stop_token_ids),
                                  ignore_eos=s.ignore_eos)
    for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "logprobs", "prompt_logprobs",
                 "min_p"):
        value = getattr(s, name)
        if value is not None:
            setattr(p, name, value)
    p.min_tokens = s.min_tokens
    for token_id, bias in s.logit_bias:
        p.logit_bias[token_id] = bias
    vllm_extras.to_proto(s, p)
    if s.structured is not None:
        st = s.structured
        if st.kind == "json_object":
            p.structured.json_object = True
        elif st.kind == "choice":
            p.structured.choice.choices.extend(st.choices)
        else:  # json_schema | regex | grammar: the text
            setattr(p.structured, st.kind, st.value)
    return p


def check_logprobs(job: Job, resp: worker_pb2.GenerateResponse, first: bool) -> None:
    """ApiError 502 when the worker's log-probabilities do not match what was asked (one
    per token; the prompt's on the first chunk): never a silently short answer."""
    s = job.req.sampling
    if s.logprobs is not None and len(resp.logprobs) != len(resp.token_ids):
        raise ApiError(502, f"the worker returned {len(resp.logprobs)} log-probabilities for "
                       f"{len(resp.token_ids)} tokens", type="upstream_error")
    if first and s.prompt_logprobs is not None and resp.token_ids and (
            len(resp.prompt_logprobs) != len(job.token_ids)):
        raise ApiError(502, f"the worker returned {len(resp.prompt_logprobs)} prompt "
                       f"log-probabilities for a prompt of {len(job.token_ids)} tokens",
                       type="upstream_error")
