"""Feature DP (TablePuppet Sec. 4.3.2; docs/algorithms.md, Privacy): DP-SGD with Opacus on ONE client's local
model, the privacy unit being one row of its table (see :mod:`tpflower.privacy` for what the guarantee
covers, the sampling assumption and the noise randomness)."""

from __future__ import annotations

import math
import secrets
import warnings
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

# Opacus is imported where it is used: it pulls in torch.distributed and sympy (about 1 s per process), which
# a run without feature DP, and the server, never need.
from torch import Tensor, nn

from tpflower.models import l2_penalty
from tpflower.params import nonnegative_finite, positive_finite, rate
from tpflower.privacy.accounting import checked_history, opacus_api, rdp_epsilon


def _device_of(model: nn.Module) -> torch.device:
    """The device of a model's parameters (the CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


class DPLocalTrainer:
    """DP-SGD for ONE client's local model f_i (Opacus), with its own RDP accountant.

    Wraps ``model`` in an Opacus ``GradSampleModule`` (hooks on the model itself: the parameters are the same
    objects, no copy) and steps it with a ``DPOptimizer`` (flat clipping at ``max_grad_norm`` = C, Gaussian
    noise ``noise_multiplier * C`` on the sum of clipped per-row gradients). Every DP step records
    ``(noise_multiplier, sample_rate)`` in the accountant; :meth:`epsilon` reports the budget spent.

    Opacus clips with the factor ``min(1, C / (||g_u|| + 1e-6))`` (so a clipped row has norm just below C).

    State between Flower messages: :meth:`state_dict` (the plain module state, no ``_module.`` prefix) and
    :meth:`accountant_state` (a list of ``[sigma, q, steps]``); rebuild with :meth:`from_state`.
    Use :meth:`predict` (no autograd) for forward messages: a forward pass with autograd on, in train mode,
    makes the Opacus hooks store activations for a backward pass that never comes.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        noise_multiplier: float,
        max_grad_norm: float,
        sample_rate: float | None = None,
        seed: int | None = None,
        secure_mode: bool = False,
        regularizer: Callable[[nn.Module], Tensor] = l2_penalty,
        history: Iterable[Sequence[float]] = (),
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch nn.Module, got {type(model).__name__}")
        self.noise_multiplier = nonnegative_finite("noise_multiplier", noise_multiplier)
        self.max_grad_norm = positive_finite("max_grad_norm (clip C)", max_grad_norm)
        self.sample_rate = None if sample_rate is None else rate("sample_rate", sample_rate)
        self.secure_mode = bool(secure_mode)
        self.regularizer = regularizer
        if hasattr(model, "autograd_grad_sample_hooks"):
            raise ValueError(
                "this model already carries Opacus hooks (another DPLocalTrainer wraps it): reuse that trainer, "
                "call its close() first, or build the trainer on a fresh model (e.g. DPLocalTrainer.from_state)"
            )
        self._module = model
        self._gsm = opacus_api().GradSampleModule(model, batch_first=True, loss_reduction="sum", strict=True)
        self.accountant = opacus_api().RDPAccountant()
        self.accountant.history = checked_history(history)
        self.seed = None if seed is None else int(seed)
        # Opacus draws the noise on the parameters' device, with this generator: it must live there too
        self._noise_generator = torch.Generator(device=_device_of(model))
        if self.seed is None:
            self._noise_generator.manual_seed(secrets.randbits(63))
        else:
            self._noise_generator.manual_seed(_derived_seed(self.seed, self.steps))
        # plain SGD: no state; lr set per step (None for a model without parameters: steps only account)
        self._sgd = torch.optim.SGD(self._params(), lr=0.0) if self._params() else None

    # -- state ---------------------------------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The underlying local model (the same object that was passed in)."""
        return self._module

    @property
    def steps(self) -> int:
        """The number of DP steps recorded by the accountant."""
        return int(sum(int(s) for _, _, s in self.accountant.history))

    def state_dict(self) -> dict[str, Tensor]:
        """The local model's plain ``state_dict`` (keys as in the unwrapped module; no ``_module.`` prefix)."""
        return {k: v.detach().clone() for k, v in self._module.state_dict().items()}

    def load_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Load a plain ``state_dict``; a ``_module.``-prefixed one (of a GradSampleModule) is accepted too."""
        sd = {(k[len("_module.") :] if k.startswith("_module.") else k): v for k, v in state_dict.items()}
        self._module.load_state_dict(sd)

    def accountant_state(self) -> list[list[float]]:
        """The accountant's history as ``[[sigma, q, steps], ...]`` (plain floats: JSON / Flower config safe)."""
        return [[float(s), float(q), float(int(n))] for s, q, n in self.accountant.history]

    @classmethod
    def from_state(
        cls,
        model: nn.Module,
        state_dict: Mapping[str, Tensor] | None,
        accountant_state: Iterable[Sequence[float]],
        **kwargs: Any,
    ) -> DPLocalTrainer:
        """Rebuild a trainer: load ``state_dict`` (if given) into ``model`` and restore the accountant history.

        ``kwargs`` are the constructor's (``noise_multiplier``, ``max_grad_norm``, ``sample_rate``, ``seed``...).
        """
        trainer = cls(model, history=accountant_state, **kwargs)
        if state_dict is not None:
            trainer.load_state_dict(state_dict)
        return trainer

    def epsilon(self, delta: float) -> float:
        """epsilon spent so far at ``delta`` (Opacus RDP accountant; 0 before any step, inf if sigma = 0)."""
        if not self.accountant.history:
            return 0.0
        return rdp_epsilon(self.accountant.history, delta)  # == self.accountant.get_epsilon(delta), cached

    def close(self) -> nn.Module:
        """Remove the Opacus hooks and attributes from the model and return it (the trainer is then unusable)."""
        self._gsm._close()
        return self._module

    # -- forward -------------------------------------------------------------------------------------------

    def predict(self, X: Tensor) -> Tensor:
        """``f_i(theta_i; X)`` without autograd (the forward message h_i)."""
        with torch.no_grad():
            return self._module(X)

    # -- SGD (Eq. 12-13) -----------------------------------------------------------------------------------

    def sgd_step(
        self,
        X: Tensor,
        Y: Tensor,
        batch_size: int,
        lr: float,
        beta: float,
        sample_rate: float | None = None,
    ) -> None:
        """One DP step of Eq. 12-13 on the rows U_i of the batch.

        ``theta -= lr [ (sum_u clip_C(Y_u^T dh_u/dtheta) + N(0, sigma^2 C^2)) / batch_size + beta dR/dtheta ]``

        X: ``T_i[U_i]`` (|U_i| x d_i), one row per TABLE row (unique). Y: the aggregated ``Y_iu`` (|U_i| x d_c).
        ``batch_size``: |B|, the nominal number of JOINED rows of the batch (the same divisor as the
        non-private :func:`tpflower.phases.join_sgd.local_sgd_step`). ``sample_rate``: q of this step for the
        accountant (default: the constructor's; see :func:`tpflower.privacy.accounting.table_row_sample_rate`).
        """
        q = self.sample_rate if sample_rate is None else rate("sample_rate", sample_rate)
        if q is None:
            raise ValueError("sgd_step needs a sample_rate (constructor or argument) for the accountant")
        X, Y = self._check_rows(X, Y)
        batch_size = int(batch_size)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if self._sgd is not None:
            for group in self._sgd.param_groups:
                group["lr"] = float(lr)

        def per_row_loss(rows: Tensor) -> Tensor:
            return (Y[rows] * self._gsm(X[rows])).sum()

        self._dp_step(self._sgd, per_row_loss, torch.arange(len(X)), float(batch_size), float(beta), q)

    def partial_gradient(
        self,
        X: Tensor,
        Y: Tensor,
        reg_weight: float,
        sample_rate: float | None = None,
    ) -> Tensor:
        """One DP step of a LoU shard (Eq. 18): the noisy, UNNORMALISED partial gradient, as one flat vector.

        ``sum_u clip_C(Y_u^T dh_u/dtheta) + N(0, sigma^2 C^2 I) + reg_weight dR/dtheta``, in the order of
        ``module.parameters()`` (zeros for a model without parameters: the step is still accounted). The model
        is not changed: the coordinator sums the shards' vectors, divides by |B| and every shard applies the
        same step (Eq. 17, 19). ``reg_weight`` is ``beta G_sum`` with G_sum the number of the batch's joined
        rows that use this shard's rows (sent by the server, which knows it): the regulariser is data
        independent given it and is added unclipped, after the noise (post-processing). Each shard adds the
        full noise (see the note on LoU at the top of this module). An empty X (the shard has no row in the batch) gives
        pure noise.
        """
        q = self.sample_rate if sample_rate is None else rate("sample_rate", sample_rate)
        if q is None:
            raise ValueError("partial_gradient needs a sample_rate (constructor or argument) for the accountant")
        X, Y = self._check_rows(X, Y)
        params = list(self._module.parameters())
        trainable = self._params()
        out: Tensor
        if trainable and self._sgd is not None:
            dp = opacus_api().DPOptimizer(
                self._sgd,
                noise_multiplier=self.noise_multiplier,
                max_grad_norm=self.max_grad_norm,
                expected_batch_size=None,
                loss_reduction="sum",  # p.grad = sum of clipped per-row gradients + noise, not divided
                generator=self._noise_generator,
                secure_mode=self.secure_mode,
            )
            was_training = self._module.training
            self._module.train()
            dp.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                (Y * self._gsm(X)).sum().backward()
            dp.pre_step()  # clip per row, sum, add N(0, sigma^2 C^2)
            reg_weight = float(reg_weight)
            if reg_weight != 0.0:
                reg = torch.autograd.grad(reg_weight * self.regularizer(self._module), trainable, allow_unused=True)
                with torch.no_grad():
                    for p, g in zip(trainable, reg):
                        if g is not None:
                            p.grad.add_(g)
            out = torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).clone() for p in params]
            )
            dp.zero_grad(set_to_none=True)
            self._module.train(was_training)
        else:
            out = torch.cat([torch.zeros_like(p).reshape(-1) for p in params]) if params else torch.zeros(0)
        self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=q)
        return out

    # -- ADMM theta-update (Eq. 16) ------------------------------------------------------------------------

    def admm_update(
        self,
        X: Tensor,
        G: Tensor,
        Y: Tensor,
        N: int,
        rho: float,
        beta: float,
        epochs: int,
        lr: float,
        batch_size: int,
        generator: torch.Generator,
        sampling: str = "poisson",
        optimizer: str = "adam",
        regularizer: Callable[[nn.Module], Tensor] | None = None,
    ) -> int:
        """The DP version of :func:`tpflower.phases.join_admm.admm_update_local_opt` (Eq. 16); returns the steps taken.

        Objective: ``beta R(theta) + (1/N) sum_u phi_u`` with the per-row term
        ``phi_u = Y_u^T f_u + rho G_u / 2 ||f_u||^2`` over the n_a active rows (G_u > 0; the others have
        Y_u = 0, G_u = 0 and no gradient). Each step: per-row gradients of phi_u clipped to C, summed, plus
        N(0, sigma^2 C^2), divided by ``q N`` (an unbiased estimate of ``(1/N) sum_u grad phi_u``, as the
        non-private ``n_a / (|b| N)`` scaling), plus ``beta dR/dtheta`` (not clipped), then an Adam or SGD
        step (fresh optimiser per call, like the non-private update; it only post-processes noisy gradients).

        Sampling of the rows (``q = min(1, batch_size / n_a)``, recorded per step):

        * ``"poisson"`` (default, matches the RDP accountant exactly): ``ceil(n_a / batch_size)`` steps per
          local epoch, each including every active row independently with probability q (the batch may be
          empty; it still gets noise and is still a step). The divisor is the expected ``q N``.
        * ``"shuffle"``: the non-private scheme (a permutation of the active rows cut into batches of
          ``batch_size``); divisor ``|b| N / n_a`` of the actual batch. The Poisson accountant is then the
          usual approximation, not a proof. With sigma = 0 and a huge C this reproduces
          ``admm_update_local_opt`` with the same ``generator``.

        ``regularizer`` replaces ``R`` for this call (default: the trainer's, ``1/2 ||theta||^2``); e.g. the
        LoU shard step (Eq. 22) passes ``lambda m: rho'/2 ||theta(m) - w + u^q||^2`` with ``beta = 1``. It
        must not depend on the rows (it is added after noising, unclipped).
        """
        if sampling not in ("poisson", "shuffle"):
            raise ValueError(f"unknown sampling {sampling!r}; expected 'poisson' or 'shuffle'")
        if optimizer not in ("adam", "sgd"):
            raise ValueError(f"unknown optimizer {optimizer!r}; expected 'adam' or 'sgd'")
        X, Y = self._check_rows(X, Y)
        G = torch.as_tensor(G)
        if G.shape != (len(X),):
            raise ValueError(f"G must have shape ({len(X)},), got {tuple(G.shape)}")
        N, batch_size, epochs = int(N), int(batch_size), int(epochs)
        if N < 1 or batch_size < 1 or epochs < 0:
            raise ValueError(f"need N >= 1, batch_size >= 1, epochs >= 0; got {N}, {batch_size}, {epochs}")
        active = torch.nonzero(G > 0).flatten()
        n_a = len(active)
        if n_a == 0 or epochs == 0:
            return 0
        q = min(1.0, batch_size / n_a)
        Gf = G.to(Y.dtype)
        rho = float(rho)
        params = self._params()
        inner: torch.optim.Optimizer | None = None
        if params:
            inner = torch.optim.Adam(params, lr=lr) if optimizer == "adam" else torch.optim.SGD(params, lr=lr)

        def per_row_loss(rows: Tensor) -> Tensor:
            f = self._gsm(X[rows])
            return (Y[rows] * f).sum() + 0.5 * rho * (Gf[rows, None] * f * f).sum()

        steps = 0
        per_epoch = math.ceil(n_a / min(batch_size, n_a))
        for _ in range(epochs):
            if sampling == "poisson":
                for _ in range(per_epoch):
                    if q >= 1.0:
                        rows = active
                    else:
                        rows = active[torch.rand(n_a, generator=generator, dtype=torch.float64) < q]
                    self._dp_step(inner, per_row_loss, rows, q * N, float(beta), q, regularizer)
                    steps += 1
            else:
                perm = active[torch.randperm(n_a, generator=generator)]
                for s in range(0, n_a, batch_size):
                    rows = perm[s : s + batch_size]
                    self._dp_step(inner, per_row_loss, rows, len(rows) * N / n_a, float(beta), q, regularizer)
                    steps += 1
        return steps

    # -- internals -----------------------------------------------------------------------------------------

    def _params(self) -> list[nn.Parameter]:
        return [p for p in self._module.parameters() if p.requires_grad]

    def _check_rows(self, X: Tensor, Y: Tensor) -> tuple[Tensor, Tensor]:
        X, Y = torch.as_tensor(X), torch.as_tensor(Y)
        if X.dim() != 2 or Y.dim() != 2 or len(X) != len(Y):
            raise ValueError(
                f"X and Y must be 2-d with the same number of rows, got {tuple(X.shape)}, {tuple(Y.shape)}"
            )
        return X, Y

    def _dp_step(
        self,
        inner: torch.optim.Optimizer | None,
        per_row_loss: Callable[[Tensor], Tensor],
        rows: Tensor,
        divisor: float,
        beta: float,
        sample_rate: float,
        regularizer: Callable[[nn.Module], Tensor] | None = None,
    ) -> None:
        """clip each row's gradient of ``per_row_loss`` (a SUM over rows) to C, add noise, divide, add beta dR, step."""
        params = self._params()
        if params and inner is not None:
            dp = opacus_api().DPOptimizer(
                inner,
                noise_multiplier=self.noise_multiplier,
                max_grad_norm=self.max_grad_norm,
                expected_batch_size=divisor,
                loss_reduction="mean",  # p.grad = (sum of clipped + noise) / expected_batch_size
                generator=self._noise_generator,
                secure_mode=self.secure_mode,
            )
            was_training = self._module.training
            self._module.train()
            dp.zero_grad(set_to_none=True)
            with warnings.catch_warnings():  # inputs do not require grad: torch warns about the full backward hook
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                per_row_loss(rows).backward()
            dp.pre_step()  # clip per row, sum, add N(0, sigma^2 C^2), divide by `divisor` (no step yet)
            if beta != 0.0:
                R = (regularizer or self.regularizer)(self._module)
                reg = torch.autograd.grad(beta * R, params, allow_unused=True)
                with torch.no_grad():
                    for p, g in zip(params, reg):
                        if g is not None:
                            p.grad.add_(g)
            inner.step()
            dp.zero_grad(set_to_none=True)  # drop grad_sample / summed_grad
            self._module.train(was_training)
        self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=sample_rate)


# ----------------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------------


def _derived_seed(seed: int, steps: int) -> int:
    return zlib.crc32(f"tpflower-dp-noise:{int(seed)}:{int(steps)}".encode()) * 2654435761 % 2**63
