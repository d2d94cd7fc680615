"""slime's ``Sample`` contract, vendored as a stand-in: slime is not on PyPI, so the adapter's samples are checked
against this copy of its fields.

Source: github.com/THUDM/slime, commit 624b824a898ab0ec1fcb4d373004c7f3852bf515 (2026-08-21), file
``slime/utils/types.py``: ``class Sample`` lines 93-220 (fields 97-128, ``class Status(Enum)`` 130-138, ``status``
140, ``metadata`` ... ``non_generation_time`` 142-151, ``SpecInfo`` 153-191, ``PrefixCacheInfo`` 193-220). Field
names, order, annotations (verbatim, as text: ``torch.Tensor`` is only named, never imported) and defaults are
slime's; the methods are left out except the length check slime runs after every append
(``_validate_response_metadata_lengths``, lines 418-425, without its top-p part). Update this file with the commit
when slime's ``Sample`` changes.

How slime nests a rollout that is several samples (the adapter's multi-segment layout) is pinned in the same commit:
``slime/rollout/sglang_rollout.py`` 300-306, ``slime/observability/rollout_data_utils.py`` 92-121,
``slime/ray/rollout.py`` 601-604, ``slime/agent/trajectory.py`` 248-261.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"


@dataclass
class Sample:
    """The sample generated"""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    # prompt
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None  # raw multimodal data, e.g. images, videos, etc.
    multimodal_train_inputs: dict[str, Any] | None = None  # processed multimodal data, e.g. pixel_values, etc.
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    # response
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None  # Log probabilities from rollout engine
    rollout_top_p_token_ids: list[int] | torch.Tensor | None = None
    rollout_top_p_token_offsets: list[int] | torch.Tensor | None = None
    rollout_routed_experts: list[list[int]] | torch.Tensor | None = None  # Routed experts from rollout engine
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None  # Log probabilities from teacher model for OPD

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING

    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    # metadata used during training, e.g., what loss to use for this sample.
    train_metadata: dict | None = None

    # Session ID for consistent hashing routing (used when router policy is consistent_hashing)
    session_id: str | None = None

    non_generation_time: float = 0.0  # time spent in non-generation steps

    @dataclass
    class SpecInfo:
        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

    spec_info: SpecInfo = field(default_factory=SpecInfo)

    @dataclass
    class PrefixCacheInfo:
        cached_tokens: int = 0
        total_prompt_tokens: int = 0

    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    def _validate_response_metadata_lengths(self) -> None:
        if self.loss_mask is not None and len(self.loss_mask) != self.response_length:
            raise ValueError(f"loss_mask length {len(self.loss_mask)} != response_length {self.response_length}")

        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != self.response_length:
            raise ValueError(
                f"rollout_log_probs length {len(self.rollout_log_probs)} != response_length {self.response_length}"
            )


FIELDS = (
    "group_index", "index", "rollout_id", "prompt", "tokens", "multimodal_inputs", "multimodal_train_inputs",
    "multimodal_train_input_id", "apply_chat_template_kwargs", "response", "response_length", "label", "reward",
    "loss_mask", "weight_versions", "rollout_log_probs", "rollout_top_p_token_ids", "rollout_top_p_token_offsets",
    "rollout_routed_experts", "remove_sample", "teacher_log_probs", "status", "metadata", "generate_function_path",
    "custom_rm_path", "train_metadata", "session_id", "non_generation_time", "spec_info", "prefix_cache_info",
)
"""slime's field names in declaration order at ``SLIME_COMMIT`` (a second copy: the test checks the dataclass
against it, so an edit of one without the other fails)."""

STATUSES = {"PENDING": "pending", "COMPLETED": "completed", "TRUNCATED": "truncated", "ABORTED": "aborted",
            "FAILED": "failed"}
"""``Sample.Status`` members and values at ``SLIME_COMMIT``."""


def validate_rollout_id_annotated(node: Any, depth: int = 0) -> None:
    """slime's check of a rollout function's nested output (``slime/observability/rollout_data_utils.py`` 92-121 at
    ``SLIME_COMMIT``, its docstring left out): a ``list[Sample]`` at depth >= 2 is one rollout split into several
    training samples, and every sibling must carry the same, set ``rollout_id``."""
    if isinstance(node, Sample):
        return
    assert isinstance(node, list), f"unexpected rollout output node type: {type(node).__name__}"
    if node and isinstance(node[0], Sample):
        if depth >= 2 and len(node) > 1:
            rids = [sample.rollout_id for sample in node]
            missing = [i for i, rollout_id in enumerate(rids) if rollout_id is None]
            assert not missing, (
                f"Compact rollout returned {len(node)} samples but rollout_id is unset on "
                f"positions {missing}. Set Sample.rollout_id on every sibling so the loss "
                "reducer can aggregate them as one rollout instead of N."
            )
            assert len(set(rids)) == 1, f"Sibling samples from one compact rollout must share rollout_id; got {rids}."
        return
    for item in node:
        validate_rollout_id_annotated(item, depth + 1)


def flatten(data: list[Any]) -> list[Sample]:
    """What slime's ``RolloutManager._get_rollout_data`` does with the output after that check
    (``slime/ray/rollout.py`` 603-604 at ``SLIME_COMMIT``): flatten while the FIRST element is a list."""
    import itertools

    while isinstance(data[0], list):
        data = list(itertools.chain.from_iterable(data))
    return data
