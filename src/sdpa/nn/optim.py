r"""AdamW, Adam with decoupled weight decay (Loshchilov and Hutter, 2019), as PyTorch has it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Real

import numpy as np

__all__ = ["AdamW"]


def _check_real(
    value, name: str, *, low: float, high: float | None = None, high_open: bool = False
) -> float:
    """A finite real number in ``[low, high]`` (``[low, high)`` with ``high_open``)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number; got {value!r}")
    above = high is not None and (value >= high if high_open else value > high)
    if not math.isfinite(value) or value < low or above:
        interval = f"[{low}, {'inf' if high is None else high}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be a finite number in {interval}; got {value!r}")
    return float(value)


class AdamW:
    r"""The AdamW optimiser over a dict of named arrays, step for step equal to PyTorch's.

    Parameters
    ----------
    params : dict of str to np.ndarray
        The arrays to optimise, for example ``DecoderLM.params``. They are updated
        *in place* by :meth:`step` (the dict and its arrays are kept, not copied), so a model
        that holds them sees every update.
    lr : float, default 1e-3
        Learning rate. The attribute ``lr`` may be changed between steps (a schedule).
    betas : (float, float), default (0.9, 0.999)
        Decay rates of the running means of the gradient and of its square, each in ``[0, 1)``.
    eps : float, default 1e-8
        Added to the root of the second moment before dividing.
    weight_decay : float, default 0.01
        Decoupled weight decay: every step multiplies each parameter by ``1 - lr * weight_decay``
        before the Adam update. It applies to every array in ``params``.

    Attributes
    ----------
    params : dict of str to np.ndarray
        The same dict that was passed in.
    lr, betas, eps, weight_decay
        The hyperparameters.
    step_count : int
        Number of steps taken.
    exp_avg, exp_avg_sq : dict of str to np.ndarray
        First and second moment estimates, keyed like ``params``.

    Raises
    ------
    TypeError
        If ``params`` is not a dict of floating NumPy arrays keyed by strings, or a
        hyperparameter is not a real number (``betas`` not a pair).
    ValueError
        If ``lr``, ``eps`` or ``weight_decay`` is negative or not finite, a beta is outside
        ``[0, 1)``, or an array in ``params`` is read-only.

    Notes
    -----
    Step :math:`t` with gradient :math:`g`, as in ``torch.optim.AdamW``:

    .. math::
        \theta &\leftarrow \theta (1 - \eta\lambda) \\
        m &\leftarrow \beta_1 m + (1 - \beta_1) g, \qquad
        v \leftarrow \beta_2 v + (1 - \beta_2) g^2 \\
        \theta &\leftarrow \theta - \frac{\eta}{1 - \beta_1^t}\,
                 \frac{m}{\sqrt{v} / \sqrt{1 - \beta_2^t} + \epsilon}.

    The moments are kept in each parameter's dtype.

    Examples
    --------
    Minimise :math:`(w - 3)^2` from :math:`w = 0`:

    >>> import numpy as np
    >>> from sdpa.nn import AdamW
    >>> params = {"w": np.zeros(1)}
    >>> opt = AdamW(params, lr=0.1, weight_decay=0.0)
    >>> for _ in range(300):
    ...     opt.step({"w": 2 * (params["w"] - 3.0)})
    >>> np.round(params["w"], 2)
    array([3.])
    >>> opt.step_count
    300
    """

    def __init__(
        self,
        params: dict[str, np.ndarray],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ):
        if not isinstance(params, Mapping):
            raise TypeError(
                f"params must be a dict of named NumPy arrays; got {type(params).__name__}"
            )
        for name, p in params.items():
            if not isinstance(name, str) or not isinstance(p, np.ndarray) or p.dtype.kind != "f":
                raise TypeError(
                    "params must map str names to floating NumPy arrays (updated in place); "
                    f"got {name!r}: {type(p).__name__} {getattr(p, 'dtype', '')}".rstrip()
                )
            if not p.flags.writeable:
                raise ValueError(f"params[{name!r}] is read-only; AdamW updates it in place")
        self.lr = _check_real(lr, "lr", low=0.0)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"betas must be a pair (beta1, beta2); got {betas!r}")
        self.betas = tuple(
            _check_real(b, f"betas[{i}]", low=0.0, high=1.0, high_open=True)
            for i, b in enumerate(betas)
        )
        self.eps = _check_real(eps, "eps", low=0.0)
        self.weight_decay = _check_real(weight_decay, "weight_decay", low=0.0)
        self.params = params
        self.step_count = 0
        self.exp_avg = {name: np.zeros_like(p) for name, p in params.items()}
        self.exp_avg_sq = {name: np.zeros_like(p) for name, p in params.items()}

    def __repr__(self) -> str:
        return (
            f"AdamW({len(self.params)} arrays, lr={self.lr}, betas={self.betas}, eps={self.eps}, "
            f"weight_decay={self.weight_decay}, step_count={self.step_count})"
        )

    def _check_grads(self, grads) -> None:
        if not isinstance(grads, Mapping):
            raise TypeError(f"grads must be a dict keyed like params; got {type(grads).__name__}")
        if set(grads) != set(self.params):
            missing = sorted(set(self.params) - set(grads))
            extra = sorted(set(grads) - set(self.params))
            raise ValueError(
                f"grads must have exactly the keys of params; missing {missing}, extra {extra}"
            )
        for name, p in self.params.items():
            shape = np.shape(grads[name])
            if shape != p.shape:
                raise ValueError(
                    f"grads[{name!r}] must have the shape of params[{name!r}], {p.shape}; "
                    f"got {shape}"
                )

    def step(self, grads: dict[str, np.ndarray]) -> None:
        """Update every array of ``params`` in place, one AdamW step.

        Parameters
        ----------
        grads : dict of str to array_like
            The gradient of the loss with respect to each parameter, keyed like ``params``
            and shaped like it (for example the ``grads`` of
            :meth:`sdpa.nn.DecoderLM.loss_and_grads`). Converted to each parameter's dtype.

        Raises
        ------
        TypeError
            If ``grads`` is not a dict.
        ValueError
            If its keys differ from those of ``params`` or a gradient has the wrong shape.

        Examples
        --------
        The first step moves every entry by about ``lr`` against the sign of its gradient,
        whatever the gradient's size (the second moment normalises it):

        >>> import numpy as np
        >>> from sdpa.nn import AdamW
        >>> params = {"w": np.zeros(3)}
        >>> AdamW(params, lr=0.01, weight_decay=0.0).step({"w": np.array([-5.0, 0.1, 2.0])})
        >>> np.round(params["w"], 6)
        array([ 0.01, -0.01, -0.01])
        """
        self._check_grads(grads)
        self.step_count += 1
        beta1, beta2 = self.betas
        bias_correction1 = 1.0 - beta1**self.step_count
        bias_correction2_sqrt = math.sqrt(1.0 - beta2**self.step_count)
        step_size = self.lr / bias_correction1
        for name, p in self.params.items():
            g = np.asarray(grads[name], dtype=p.dtype)
            m, v = self.exp_avg[name], self.exp_avg_sq[name]
            p *= p.dtype.type(1.0 - self.lr * self.weight_decay)  # decoupled weight decay
            m += (g - m) * p.dtype.type(1.0 - beta1)  # m <- beta1 m + (1 - beta1) g
            v *= p.dtype.type(beta2)
            v += p.dtype.type(1.0 - beta2) * g * g
            denom = np.sqrt(v) / p.dtype.type(bias_correction2_sqrt) + p.dtype.type(self.eps)
            p -= p.dtype.type(step_size) * m / denom
