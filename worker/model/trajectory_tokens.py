"""Trajectory tokenizers: history -> `<i0..i999>` ids, future -> `<i1000..i3999>` ids.

Docs: alpamayo2-model.md sections 2.6 (history, `DeltaTrajectoryTokenizer`), 2.7 (future,
`DiscreteTrajectoryTokenizer`), 1.2 (config keys) and 1.4 (token ids).

* History: the 16 history positions become 15 (or 16 with ``pad_origin_at_beginning``) xyz
  deltas, each binned uniformly over ``[xyz_min, xyz_max]`` into 1000 bins, flattened
  ``dx0, dy0, dz0, dx1, ...`` and offset by ``history_id0``. The ids replace the 45
  ``<|traj_history|>`` placeholders in order.
* Future (auto-labeling input only): the 64 future poses become a normalised (accel, curvature)
  action via :func:`worker.model.action_space.trajectory_to_action`, binned over
  ``[dims_min, dims_max]`` into 3000 bins, flattened ``a0, k0, a1, k1, ...`` and offset by
  ``future_id0``. The ids replace the 128 ``<|traj_future|>`` placeholders in order.

Binning is ``clamp(round((x - lo) / (hi - lo) * (num_bins - 1)), 0, num_bins - 1)`` with
``torch.round`` (round half to even), computed in float32 (float64 input stays float64), exactly
as the reference code does it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from worker.model.action_space import (
    UnicycleActionSpaceConfig,
    action_to_trajectory,
    trajectory_to_action,
)

__all__ = [
    "DEFAULT_HISTORY_ID0",
    "DEFAULT_FUTURE_ID0",
    "HistoryTokenizer",
    "FutureTokenizer",
    "history_tokenizer_from_config",
    "future_tokenizer_from_config",
    "tokenizers_from_config",
]

#: `<i0>` in the release tokenizer (`traj_ids.history_id0`).
DEFAULT_HISTORY_ID0 = 151669
#: `<i1000>` in the release tokenizer (`traj_ids.future_id0`).
DEFAULT_FUTURE_ID0 = 152669


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _quantize(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, num_bins: int) -> torch.Tensor:
    """Uniform bins with round-half-to-even and clamping. Same shape, int64 bins."""
    u = (x - lo) / (hi - lo)
    return (u * (num_bins - 1)).round().long().clamp(0, num_bins - 1)


def _dequantize(
    bins: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, num_bins: int
) -> torch.Tensor:
    """Bin centres: ``bins / (num_bins - 1) * (hi - lo) + lo`` (float32)."""
    return bins.to(torch.float32) / (num_bins - 1) * (hi - lo) + lo


def _check_ids(ids: torch.Tensor, id0: int, num_bins: int, n: int, what: str) -> torch.Tensor:
    if ids.ndim < 1 or ids.shape[-1] != n:
        raise ValueError(f"{what}.decode: ids shape={tuple(ids.shape)}, expected=(B, {n})")
    if ids.is_floating_point():
        raise ValueError(f"{what}.decode: ids dtype={ids.dtype}, expected an integer tensor")
    bins = ids.long() - id0
    if bins.numel() and (bool((bins < 0).any()) or bool((bins >= num_bins).any())):
        raise ValueError(
            f"{what}.decode: ids outside [{id0}, {id0 + num_bins}) "
            f"(found min={int(ids.min())}, max={int(ids.max())})"
        )
    return bins


def _triple(v: Sequence[float], name: str, n: int) -> tuple[float, ...]:
    t = tuple(float(x) for x in v)
    if len(t) != n:
        raise ValueError(f"{name}={list(v)!r}, expected {n} values")
    return t


# --------------------------------------------------------------------------------------------
# history
# --------------------------------------------------------------------------------------------


class HistoryTokenizer:
    """Delta history tokenizer (`DeltaTrajectoryTokenizer`, xyz only).

    Args:
        num_bins: bins per axis (1000).
        xyz_min / xyz_max: per-axis delta range in metres per 0.1 s step ((-4,-4,-10)/(4,4,10)).
        pad_origin_at_beginning: False in the release: 16 poses give 15 deltas (45 tokens) and
            decoding anchors the last pose at the origin. True: the origin is prepended, 16
            deltas (48 tokens), decoding starts from the origin.
        history_id0: token id of bin 0 (`<i0>`).
        num_points: number of history poses (16).
    """

    def __init__(
        self,
        num_bins: int = 1000,
        xyz_min: Sequence[float] = (-4.0, -4.0, -10.0),
        xyz_max: Sequence[float] = (4.0, 4.0, 10.0),
        pad_origin_at_beginning: bool = False,
        history_id0: int = DEFAULT_HISTORY_ID0,
        num_points: int = 16,
    ) -> None:
        if int(num_bins) < 2:
            raise ValueError(f"HistoryTokenizer: num_bins={num_bins}, expected >= 2")
        self.num_bins = int(num_bins)
        self.xyz_min = _triple(xyz_min, "xyz_min", 3)
        self.xyz_max = _triple(xyz_max, "xyz_max", 3)
        if any(hi <= lo for lo, hi in zip(self.xyz_min, self.xyz_max)):
            raise ValueError(
                f"HistoryTokenizer: xyz_min={self.xyz_min} must be < xyz_max={self.xyz_max}"
            )
        self.pad_origin_at_beginning = bool(pad_origin_at_beginning)
        self.history_id0 = int(history_id0)
        self.num_points = int(num_points)

    @property
    def num_deltas(self) -> int:
        """Deltas per trajectory: 15 (or 16 with ``pad_origin_at_beginning``)."""
        return self.num_points if self.pad_origin_at_beginning else self.num_points - 1

    @property
    def num_tokens(self) -> int:
        """Tokens per trajectory: 45 (or 48 with ``pad_origin_at_beginning``)."""
        return 3 * self.num_deltas

    @property
    def vocab_size(self) -> int:
        return self.num_bins

    def __repr__(self) -> str:
        return (
            f"HistoryTokenizer(num_bins={self.num_bins}, xyz_min={self.xyz_min}, "
            f"xyz_max={self.xyz_max}, pad_origin_at_beginning={self.pad_origin_at_beginning}, "
            f"history_id0={self.history_id0}, num_tokens={self.num_tokens})"
        )

    def encode_bins(self, hist_xyz: torch.Tensor) -> torch.Tensor:
        """History positions (B, 16, 3) -> bins (B, num_tokens) int64 in [0, num_bins)."""
        if hist_xyz.ndim != 3 or hist_xyz.shape[1:] != (self.num_points, 3):
            raise ValueError(
                f"HistoryTokenizer.encode: hist_xyz shape={tuple(hist_xyz.shape)}, "
                f"expected=(B, {self.num_points}, 3)"
            )
        dtype = _work_dtype(hist_xyz)
        xyz = hist_xyz.to(dtype)
        if self.pad_origin_at_beginning:
            xyz = torch.cat([torch.zeros_like(xyz[:, :1]), xyz], dim=1)
        d = xyz[:, 1:] - xyz[:, :-1]  # (B, n, 3)
        lo = torch.tensor(self.xyz_min, dtype=dtype, device=d.device)
        hi = torch.tensor(self.xyz_max, dtype=dtype, device=d.device)
        bins = _quantize(d, lo, hi, self.num_bins)
        return bins.reshape(bins.shape[0], -1)  # dx0, dy0, dz0, dx1, ...

    def encode(self, hist_xyz: torch.Tensor) -> torch.Tensor:
        """History positions (B, 16, 3) -> token ids (B, 45) int64 (bins + ``history_id0``)."""
        return self.encode_bins(hist_xyz) + self.history_id0

    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (B, num_tokens) -> history positions (B, 16, 3) float32 at bin centres.

        Without ``pad_origin_at_beginning`` the positions are cumulative sums from the end,
        ending exactly at the origin; with it, cumulative sums from the origin.
        Raises ``ValueError`` for a wrong shape or ids outside this tokenizer's range.
        """
        bins = _check_ids(ids, self.history_id0, self.num_bins, self.num_tokens, "HistoryTokenizer")
        bins = bins.reshape(*bins.shape[:-1], self.num_deltas, 3)
        lo = torch.tensor(self.xyz_min, dtype=torch.float32, device=bins.device)
        hi = torch.tensor(self.xyz_max, dtype=torch.float32, device=bins.device)
        d = _dequantize(bins, lo, hi, self.num_bins)  # (B, n, 3)
        if self.pad_origin_at_beginning:
            return torch.cumsum(d, dim=-2)
        # p_k = -(d_k + ... + d_{n-1}) for k < n, p_n = 0
        tail = torch.flip(torch.cumsum(torch.flip(d, dims=[-2]), dim=-2), dims=[-2])
        return torch.cat([-tail, torch.zeros_like(d[..., :1, :])], dim=-2)

    @classmethod
    def from_config(
        cls, cfg: Mapping[str, Any] | None, history_id0: int = DEFAULT_HISTORY_ID0
    ) -> "HistoryTokenizer":
        """Build from a ``hist_traj_tokenizer_cfg`` dict (hydra kwargs; ``_target_`` ignored).

        Accepts the reference names ``ego_xyz_min``/``ego_xyz_max`` as well as
        ``xyz_min``/``xyz_max``. ``predict_yaw: true`` is rejected (yaw tokens are not served).
        """
        cfg = dict(cfg or {})
        if cfg.get("predict_yaw"):
            raise ValueError(
                "hist_traj_tokenizer_cfg: predict_yaw=true (60/64-token yaw mode) is not "
                "supported; expected predict_yaw=false"
            )
        return cls(
            num_bins=int(cfg.get("num_bins", 1000)),
            xyz_min=cfg.get("ego_xyz_min", cfg.get("xyz_min", (-4.0, -4.0, -10.0))),
            xyz_max=cfg.get("ego_xyz_max", cfg.get("xyz_max", (4.0, 4.0, 10.0))),
            pad_origin_at_beginning=bool(cfg.get("pad_origin_at_beginning", False)),
            history_id0=int(history_id0),
        )


# --------------------------------------------------------------------------------------------
# future
# --------------------------------------------------------------------------------------------


class FutureTokenizer:
    """Discrete future tokenizer (`DiscreteTrajectoryTokenizer` over the unicycle action space).

    Args:
        action_space_cfg: the action space used for ``trajectory_to_action`` (a
            :class:`UnicycleActionSpaceConfig` or its dict form).
        num_bins: bins per action channel (3000).
        dims_min / dims_max: range per channel in *normalised* action units ((-10,-10)/(10,10);
            the Super values were not seen, these are R1's).
        future_id0: token id of bin 0 (`<i1000>`).
    """

    def __init__(
        self,
        action_space_cfg: UnicycleActionSpaceConfig | Mapping[str, Any] | None = None,
        num_bins: int = 3000,
        dims_min: Sequence[float] = (-10.0, -10.0),
        dims_max: Sequence[float] = (10.0, 10.0),
        future_id0: int = DEFAULT_FUTURE_ID0,
    ) -> None:
        if not isinstance(action_space_cfg, UnicycleActionSpaceConfig):
            action_space_cfg = UnicycleActionSpaceConfig.from_dict(action_space_cfg)
        self.action_space_cfg = action_space_cfg
        if int(num_bins) < 2:
            raise ValueError(f"FutureTokenizer: num_bins={num_bins}, expected >= 2")
        self.num_bins = int(num_bins)
        self.dims_min = _triple(dims_min, "dims_min", 2)
        self.dims_max = _triple(dims_max, "dims_max", 2)
        if any(hi <= lo for lo, hi in zip(self.dims_min, self.dims_max)):
            raise ValueError(
                f"FutureTokenizer: dims_min={self.dims_min} must be < dims_max={self.dims_max}"
            )
        self.future_id0 = int(future_id0)

    @property
    def n_waypoints(self) -> int:
        return self.action_space_cfg.n_waypoints

    @property
    def num_tokens(self) -> int:
        """Tokens per trajectory: 2 x n_waypoints = 128."""
        return 2 * self.n_waypoints

    @property
    def vocab_size(self) -> int:
        return self.num_bins

    def __repr__(self) -> str:
        return (
            f"FutureTokenizer(num_bins={self.num_bins}, dims_min={self.dims_min}, "
            f"dims_max={self.dims_max}, future_id0={self.future_id0}, num_tokens={self.num_tokens})"
        )

    def encode_action_bins(self, action: torch.Tensor) -> torch.Tensor:
        """Normalised action (B, 64, 2) -> bins (B, 128) int64, order a0, k0, a1, k1, ..."""
        if action.ndim != 3 or action.shape[1:] != (self.n_waypoints, 2):
            raise ValueError(
                f"FutureTokenizer: action shape={tuple(action.shape)}, "
                f"expected=(B, {self.n_waypoints}, 2)"
            )
        dtype = _work_dtype(action)
        action = action.to(dtype)
        lo = torch.tensor(self.dims_min, dtype=dtype, device=action.device)
        hi = torch.tensor(self.dims_max, dtype=dtype, device=action.device)
        bins = _quantize(action, lo, hi, self.num_bins)
        return bins.reshape(bins.shape[0], -1)

    def encode_action(self, action: torch.Tensor) -> torch.Tensor:
        """Normalised action (B, 64, 2) -> token ids (B, 128) int64."""
        return self.encode_action_bins(action) + self.future_id0

    def encode(
        self,
        hist_xyz: torch.Tensor,
        hist_rot: torch.Tensor,
        fut_xyz: torch.Tensor,
        fut_rot: torch.Tensor,
    ) -> torch.Tensor:
        """Future trajectory -> token ids (B, 128) int64.

        Args:
            hist_xyz: (B, 16, 3), hist_rot: (B, 16, 3, 3) history (for the initial speed).
            fut_xyz: (B, 64, 3), fut_rot: (B, 64, 3, 3) future poses in the t0 ego frame.
        """
        action = trajectory_to_action(hist_xyz, hist_rot, fut_xyz, fut_rot, self.action_space_cfg)
        return self.encode_action(action)

    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (B, 128) -> normalised action (B, 64, 2) float32 at bin centres."""
        bins = _check_ids(ids, self.future_id0, self.num_bins, self.num_tokens, "FutureTokenizer")
        bins = bins.reshape(*bins.shape[:-1], self.n_waypoints, 2)
        lo = torch.tensor(self.dims_min, dtype=torch.float32, device=bins.device)
        hi = torch.tensor(self.dims_max, dtype=torch.float32, device=bins.device)
        return _dequantize(bins, lo, hi, self.num_bins)

    def decode_trajectory(
        self, ids: torch.Tensor, hist_xyz: torch.Tensor, hist_rot: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids (B, 128) -> (xyz (B, 64, 3), rot (B, 64, 3, 3)) via action_to_trajectory."""
        return action_to_trajectory(self.decode(ids), hist_xyz, hist_rot, self.action_space_cfg)

    @classmethod
    def from_config(
        cls,
        cfg: Mapping[str, Any] | None,
        future_id0: int = DEFAULT_FUTURE_ID0,
        fallback_action_space_cfg: UnicycleActionSpaceConfig | Mapping[str, Any] | None = None,
    ) -> "FutureTokenizer":
        """Build from a ``future_traj_tokenizer_cfg`` dict (hydra kwargs; ``_target_`` ignored).

        The nested ``action_space_cfg`` is used when present, otherwise
        ``fallback_action_space_cfg`` (normally the expert's), otherwise the defaults.
        """
        cfg = dict(cfg or {})
        as_cfg = cfg.get("action_space_cfg") or cfg.get("action_space") or fallback_action_space_cfg
        return cls(
            action_space_cfg=as_cfg,
            num_bins=int(cfg.get("num_bins", 3000)),
            dims_min=cfg.get("dims_min", (-10.0, -10.0)),
            dims_max=cfg.get("dims_max", (10.0, 10.0)),
            future_id0=int(future_id0),
        )


# --------------------------------------------------------------------------------------------
# from the checkpoint config
# --------------------------------------------------------------------------------------------


def _traj_id(config: Mapping[str, Any], key: str, default: int) -> int:
    traj_ids = config.get("traj_ids") or {}
    value = traj_ids.get(key, default)
    return int(value)


def history_tokenizer_from_config(config: Mapping[str, Any]) -> HistoryTokenizer:
    """History tokenizer from the checkpoint ``config.json`` dict.

    Reads ``hist_traj_tokenizer_cfg`` and ``traj_ids.history_id0`` (default 151669), and checks
    ``tokens_per_history_traj`` when present.
    """
    tok = HistoryTokenizer.from_config(
        config.get("hist_traj_tokenizer_cfg"), _traj_id(config, "history_id0", DEFAULT_HISTORY_ID0)
    )
    configured = config.get("tokens_per_history_traj")
    if configured is not None and int(configured) != tok.num_tokens:
        raise ValueError(
            f"tokens_per_history_traj: configured={configured}, expected={tok.num_tokens} "
            f"(pad_origin_at_beginning={tok.pad_origin_at_beginning})"
        )
    return tok


def future_tokenizer_from_config(config: Mapping[str, Any]) -> FutureTokenizer:
    """Future tokenizer from the checkpoint ``config.json`` dict.

    Reads ``future_traj_tokenizer_cfg`` (its ``action_space_cfg``, else
    ``expert_config.action_space_cfg``), ``traj_ids.future_id0`` (default 152669), and checks
    ``tokens_per_future_traj`` when present.
    """
    expert = config.get("expert_config") or {}
    tok = FutureTokenizer.from_config(
        config.get("future_traj_tokenizer_cfg"),
        _traj_id(config, "future_id0", DEFAULT_FUTURE_ID0),
        fallback_action_space_cfg=expert.get("action_space_cfg"),
    )
    configured = config.get("tokens_per_future_traj")
    if configured is not None and int(configured) != tok.num_tokens:
        raise ValueError(
            f"tokens_per_future_traj: configured={configured}, expected={tok.num_tokens}"
        )
    return tok


def tokenizers_from_config(config: Mapping[str, Any]) -> tuple[HistoryTokenizer, FutureTokenizer]:
    """``(history_tokenizer_from_config(config), future_tokenizer_from_config(config))``."""
    return history_tokenizer_from_config(config), future_tokenizer_from_config(config)
