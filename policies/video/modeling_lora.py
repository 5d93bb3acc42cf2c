"""Named LoRA adapters on a diffusers transformer (peft), and an EMA of named parameters.

`NamedLoraAdapters` is a mixin for a module holding a peft-capable diffusers model as `self.transformer` (diffusers'
`PeftAdapterMixin`: add_adapter / set_adapter / disable_adapters) and LoRA defaults in `self.config` (lora_rank,
lora_alpha, lora_targets). It keeps several adapters side by side: "default" trains, "old"/"ref"/"ema" are
snapshots made by `copy_adapter` / `lerp_adapter` instead of model copies, and the reserved name "base" is the
model with every adapter off. Switching adapters never changes which weights require grad: only the active
adapter's LoRA weights do (peft's own switching flips those flags; `_keep_grad_flags` undoes that).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

BASE = "base"  # reserved adapter name: the base model with every adapter disabled


class NamedLoraAdapters:
    """Mixin: named LoRA adapters on `self.transformer`. Call `_init_adapters()` in the host's __init__."""

    transformer: nn.Module
    config: Any

    def _init_adapters(self) -> None:
        self._adapters: dict[str, dict[str, Any]] = {}  # name -> {"rank", "alpha", "targets"}
        self._active: str | None = None
        self._disabled = False  # inside disable_adapters()

    @property
    def adapters(self) -> list[str]:
        return list(self._adapters)

    @property
    def active_adapter(self) -> str | None:
        return self._active

    def add_adapter(
        self,
        name: str = "default",
        *,
        rank: int | None = None,
        alpha: float | None = None,
        targets: Sequence[str] | None = None,
    ) -> None:
        """Inject a LoRA adapter (zero-initialised B: the model is unchanged until it trains).

        The first adapter becomes active and the base weights are frozen; later ones are added inactive.
        """
        from peft import LoraConfig

        if name == BASE or not name.isidentifier():
            raise ValueError(f"adapter name must be a Python identifier other than {BASE!r}; got {name!r}")
        if name in self._adapters:
            raise ValueError(f"adapter {name!r} already exists; adapters: {self.adapters}")
        spec = {
            "rank": int(rank or self.config.lora_rank),
            "alpha": float(alpha if alpha is not None else self.config.lora_alpha),
            "targets": list(targets or self.config.lora_targets),
        }
        names = [n for n, _ in self.transformer.named_modules()]
        unmatched = [t for t in spec["targets"] if not any(n == t or n.endswith("." + t) for n in names)]
        if unmatched:
            raise ValueError(f"LoRA targets {unmatched} matched no module of the transformer (peft matches module-name "
                             f"suffixes, e.g. 'to_q', 'ffn.net.2')")
        if not self._adapters:
            for p in self.transformer.parameters():
                p.requires_grad_(False)
        with self._keep_grad_flags(), warnings.catch_warnings():
            # peft warns on every adapter after the first; several named adapters are the point here.
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            self.transformer.add_adapter(
                LoraConfig(r=spec["rank"], lora_alpha=spec["alpha"], target_modules=spec["targets"],
                           init_lora_weights=True),
                adapter_name=name,
            )
        self._adapters[name] = spec
        if self._active is None:
            self.set_adapter(name)
        else:
            self.transformer.set_adapter(self._active)
            for p in self.lora_parameters(name).values():
                p.requires_grad_(False)

    def set_adapter(self, name: str) -> None:
        """Make `name` the adapter used by default and the only one whose weights require grad."""
        self._check_adapter(name)
        self.transformer.set_adapter(name)
        self._active = name
        for adapter in self._adapters:
            for p in self.lora_parameters(adapter).values():
                p.requires_grad_(adapter == name)

    def delete_adapter(self, name: str) -> None:
        self._check_adapter(name)
        if name == self._active:
            raise ValueError(f"cannot delete the active adapter {name!r}; set another one first")
        self.transformer.delete_adapters(name)
        del self._adapters[name]

    def copy_adapter(self, src: str, dst: str) -> None:
        """Copy adapter `src`'s weights into `dst` (created with src's rank/alpha/targets if absent), e.g.
        default -> old before an update, default -> ref once: snapshots without copying the model."""
        self._check_adapter(src)
        if dst not in self._adapters:
            spec = self._adapters[src]
            self.add_adapter(dst, rank=spec["rank"], alpha=spec["alpha"], targets=spec["targets"])
        self.load_adapter_state_dict(dst, self.adapter_state_dict(src))

    @torch.no_grad()
    def lerp_adapter(self, dst: str, src: str, *, decay: float) -> None:
        """θ_dst ← decay·θ_dst + (1 − decay)·θ_src: an EMA kept as a named adapter (decay 0 copies)."""
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1]; got {decay}")
        self._check_adapter(src)
        self._check_adapter(dst)
        src_params = self.lora_parameters(src)
        dst_params = self.lora_parameters(dst)
        if set(src_params) != set(dst_params):
            raise ValueError(f"adapters {src!r} and {dst!r} have different LoRA targets; cannot average them")
        for k, p in dst_params.items():
            p.lerp_(src_params[k], 1.0 - decay)

    def lora_parameters(self, name: str | None = None) -> dict[str, nn.Parameter]:
        """The adapter's LoRA parameters keyed by module path without the adapter name (same keys for every
        adapter, so state dicts move between adapters). Default: the active adapter."""
        name = name or self._active
        out: dict[str, nn.Parameter] = {}
        for key, p in self.transformer.named_parameters():
            parts = key.split(".")
            for i in range(1, len(parts)):
                if parts[i] == name and parts[i - 1].startswith("lora_"):
                    out[".".join(parts[:i] + parts[i + 1 :])] = p
                    break
        return out

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The active adapter's LoRA weights (what an optimiser over a post-training run should hold)."""
        if self._active is None:
            raise ValueError("no adapter yet: call add_adapter('default') first (or train base_parameters())")
        return list(self.lora_parameters(self._active).values())

    def base_parameters(self) -> list[nn.Parameter]:
        """The transformer's own weights (LoRA excluded): what pre-training trains, before any adapter exists."""
        return [p for k, p in self.transformer.named_parameters() if ".lora_" not in k]

    def base_state_dict(self) -> dict[str, Tensor]:
        """The transformer's weights under plain diffusers names (peft's `base_layer` unwrapped, LoRA dropped)."""
        out = {}
        for key, value in self.transformer.state_dict().items():
            if ".lora_" in key:
                continue
            out[key.replace(".base_layer.", ".")] = value.detach().contiguous()
        return out

    def adapter_state_dict(self, name: str) -> dict[str, Tensor]:
        self._check_adapter(name)
        return {k: p.detach().clone() for k, p in self.lora_parameters(name).items()}

    @torch.no_grad()
    def load_adapter_state_dict(self, name: str, state: Mapping[str, Tensor]) -> None:
        self._check_adapter(name)
        params = self.lora_parameters(name)
        missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        if missing or unexpected:
            raise ValueError(f"adapter {name!r} state mismatch: missing {missing[:4]}, unexpected {unexpected[:4]}"
                             " (was it made with other LoRA targets?)")
        for k, p in params.items():
            p.copy_(state[k])

    def ema(self, adapter: str | None = None, *, decay: float = 0.99) -> EMA:
        """An `EMA` of an adapter's LoRA weights (default: the active adapter)."""
        name = adapter or self._active
        self._check_adapter(name)
        return EMA(self.lora_parameters(name), decay=decay)

    @contextmanager
    def use_adapter(self, name: str | None) -> Iterator[None]:
        """Run the block with adapter `name` ("base": none; None: leave as is), then restore, grad flags included."""
        if name is None or (name == self._active and not self._disabled):
            yield
            return
        if name == BASE:
            with self.disable_adapters():
                yield
            return
        self._check_adapter(name)
        was_disabled = self._disabled
        with self._keep_grad_flags():
            if was_disabled:
                self.transformer.enable_adapters()
                self._disabled = False
            self.transformer.set_adapter(name)
            try:
                yield
            finally:
                self.transformer.set_adapter(self._active)
                if was_disabled:
                    self.transformer.disable_adapters()
                    self._disabled = True

    @contextmanager
    def disable_adapters(self) -> Iterator[None]:
        """Run the block on the base model (every adapter off)."""
        if not self._adapters or self._disabled:
            yield
            return
        with self._keep_grad_flags():
            self.transformer.disable_adapters()
            self._disabled = True
            try:
                yield
            finally:
                self.transformer.enable_adapters()
                self._disabled = False

    @contextmanager
    def mixed_adapters(self, rows: Sequence[str]) -> Iterator[None]:
        """Run the block with a different adapter per batch row (`rows`: one name per row, "base" for none), in
        one forward pass: peft's mixed-adapter batches. The base layers see the whole batch once, each adapter
        only its rows, so querying several adapters at the same inputs costs about one batched pass. Inference
        only: peft does not support it in training."""
        for name in set(rows) - {BASE}:
            self._check_adapter(name)
        from peft.tuners.lora.layer import LoraLayer

        names = ["__base__" if name == BASE else name for name in rows]  # peft's name for "no adapter"

        def inject(module, args, kwargs):
            return args, {**kwargs, "adapter_names": names}

        hooks = [m.register_forward_pre_hook(inject, with_kwargs=True) for m in self.transformer.modules()
                 if isinstance(m, LoraLayer)]  # fmt: skip
        was_disabled = self._disabled
        try:
            with self._keep_grad_flags():  # peft's enable/disable flip them
                if was_disabled:  # a disabled LoRA layer ignores adapter_names
                    self.transformer.enable_adapters()
                try:
                    yield
                finally:
                    if was_disabled:
                        self.transformer.disable_adapters()
        finally:
            for hook in hooks:
                hook.remove()

    @contextmanager
    def _keep_grad_flags(self) -> Iterator[None]:
        # peft's set_adapter / enable_adapters flip requires_grad on LoRA weights; an optimiser built over the
        # active adapter must keep its gradients whatever adapter a rollout or a reference query switches to.
        flags = [(p, p.requires_grad) for p in self.transformer.parameters()]
        try:
            yield
        finally:
            for p, flag in flags:
                p.requires_grad_(flag)

    def _check_adapter(self, name: str | None) -> None:
        if name not in self._adapters:
            raise ValueError(f"unknown adapter {name!r}; adapters: {self.adapters} (add one with add_adapter)")


class EMA:
    """Exponential moving average of named parameters (an adapter's LoRA weights, or a whole model's).

    update(decay): shadow ← decay·shadow + (1 − decay)·param. swap_in(): a context in which the parameters hold
    the shadow values (sample from the EMA with the usual calls), restored on exit. state_dict() for resume.
    """

    def __init__(self, params: Mapping[str, nn.Parameter], *, decay: float = 0.99) -> None:
        if not params:
            raise ValueError("EMA needs at least one parameter")
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay must be in [0, 1]; got {decay}")
        self.params = dict(params)
        self.decay = decay
        self.shadow = {k: p.detach().clone() for k, p in self.params.items()}
        self.num_updates = 0

    @torch.no_grad()
    def update(self, decay: float | None = None) -> None:
        d = self.decay if decay is None else decay
        for k, p in self.params.items():
            self.shadow[k].lerp_(p.detach(), 1.0 - d)
        self.num_updates += 1

    @contextmanager
    def swap_in(self) -> Iterator[None]:
        backup = {k: p.detach().clone() for k, p in self.params.items()}
        self.copy_to(self.params)
        try:
            yield
        finally:
            with torch.no_grad():
                for k, p in self.params.items():
                    p.copy_(backup[k])

    @torch.no_grad()
    def copy_to(self, params: Mapping[str, nn.Parameter]) -> None:
        for k, p in params.items():
            p.copy_(self.shadow[k])

    def state_dict(self) -> dict[str, Any]:
        shadow = {k: v.clone() for k, v in self.shadow.items()}
        return {"decay": self.decay, "num_updates": self.num_updates, "shadow": shadow}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if set(state["shadow"]) != set(self.shadow):
            raise ValueError("EMA state does not match the tracked parameters")
        self.decay = float(state["decay"])
        self.num_updates = int(state["num_updates"])
        for k, v in state["shadow"].items():
            self.shadow[k].copy_(v)
