"""The nested pipeline's dense step: the plain loop's arithmetic, cut into micro-batches.

A micro-batch's dense forward and backward must give every sample the values the plain
loop gives it, and every dense parameter the plain loop's gradient, bit for bit. Three
things would otherwise differ (measured, `docs/pipelines.md`):

- **Tails.** PyTorch's CPU elementwise kernels process `2 x` the vector width at a time and
  run the rest on a scalar path whose `sigmoid` (and others) differ by an ulp. Micro-batch
  boundaries are therefore multiples of `alignment(dtype)` samples (128 bytes of values:
  32 float32), so each sample takes the path it takes in the plain loop's batch.
- **The loss.** The plain loop's gradient at each logit is `(sigmoid(x) - y) / B` for
  `BCEWithLogitsLoss` (mean over the batch's B samples). `loss_seed` computes exactly that
  for a micro-batch's logits, for any N; a micro-batch's own mean times `b / B` would not
  be exact. The reported loss is computed once, over the whole batch's logits in data order.
- **Parameter gradients.** A weight's gradient is a sum over the batch's samples; N partial
  sums added up round differently (and Adagrad's per-element normalisation amplifies that).
  `DeferredGrads` keeps each micro-batch's operands and computes the whole batch's product
  (or sum) once, in the data's sample order: the plain loop's operation on the plain loop's
  operands.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

VECTOR_BYTES = 128  # two AVX-512 vectors: PyTorch's CPU loops step by 2 x the vector width


def alignment(dtype: torch.dtype) -> int:
    """Micro-batch boundaries fall on multiples of this many samples (32 for float32)."""
    return max(1, VECTOR_BYTES // torch.empty((), dtype=dtype).element_size())


def compute_dtype(train: torch.nn.Module, inputs: torch.dtype) -> torch.dtype:
    """The dtype the train module's dense part computes in: the one its `model` declares
    (`compute_dtype`, a model run under autocast, e.g. `recsys.models.precision`), else
    its inputs'. Micro-batch boundaries must fall on whole vector units of it."""
    return getattr(getattr(train, "model", None), "compute_dtype", inputs)


def batch_loss_fn(train: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The train module's loss as a function of (logits, labels), once the train module is
    found to meet the contract micro-batches need (docs/training.md, "Models"): TorchRec's
    `DLRMTrain` has `loss_fn` (BCEWithLogitsLoss); a module whose loss is a scaled sum
    declares `loss_reduction = "sum"` and has `loss_fn` too. Each sample's logit and loss
    must depend on that sample alone: batch norm, or a loss over the batch (in-batch
    negatives), would change with the micro-batches and is refused here, at start."""
    fn = getattr(train, "loss_fn", None)
    if fn is None or not hasattr(train, "model"):
        raise NotImplementedError(
            f"pipeline=nested needs a train module like TorchRec's DLRMTrain (a `model` "
            f"giving logits and a `loss_fn(logits, labels)`); {type(train).__name__} has "
            f"{'no loss_fn' if fn is None else 'no model'}. Use TorchRec's "
            f"TrainPipelineSparseDist (pipeline=sparse_dist)"
        )
    for name, m in train.model.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._NormBase):
            raise NotImplementedError(
                f"pipeline=nested: the model's '{name}' is a {type(m).__name__}, whose "
                f"statistics are taken over the batch; micro-batches would change them (and "
                f"the result). Use TorchRec's "
                f"TrainPipelineSparseDist (pipeline=sparse_dist), or a per-sample norm (LayerNorm)"
            )
    per_sample = (
        isinstance(fn, torch.nn.modules.loss._Loss)
        or getattr(train, "loss_reduction", "mean") == "sum"
    )
    if not (per_sample or getattr(train, "per_sample_loss", False)):
        raise NotImplementedError(
            f"pipeline=nested: {type(train).__name__}.loss_fn ({type(fn).__name__}) is not "
            f"one of torch's per-sample losses, so it may couple samples (e.g. in-batch "
            f"negatives), which micro-batches would change. Use TorchRec's "
            f"TrainPipelineSparseDist (pipeline=sparse_dist), or set "
            f"`per_sample_loss = True` on the train module if each sample's loss depends on "
            f"that sample alone"
        )
    return fn


def exact_seed(train: torch.nn.Module) -> bool:
    """Whether `loss_seed` gives each logit exactly the plain loop's gradient."""
    fn = train.loss_fn
    if getattr(train, "loss_reduction", "mean") == "sum":
        return True  # each sample's gradient does not depend on the others
    return (
        isinstance(fn, torch.nn.BCEWithLogitsLoss)
        and fn.reduction == "mean"
        and fn.weight is None
        and fn.pos_weight is None
    )


def loss_seed(
    train: torch.nn.Module, logits: torch.Tensor, labels: torch.Tensor, batch: int
) -> torch.Tensor:
    """d(the whole batch's loss) / d(these logits), computed as the plain loop's backward
    computes it; `batch` is the rank's batch size."""
    fn, summed = train.loss_fn, getattr(train, "loss_reduction", "mean") == "sum"
    if exact_seed(train) and not summed:
        # autograd's formula for BCE's backward (FunctionsManual.cpp, no weights):
        # (sigmoid(x) - y) * grad, then / numel under the mean, with grad = 1 and the plain
        # loop's numel; computed directly: no forward loss and no graph to run
        return (logits.detach().sigmoid() - labels).div_(batch)
    x = logits.detach().requires_grad_()
    with torch.enable_grad():
        if summed:
            (grad,) = torch.autograd.grad(fn(x, labels), x)
            return grad
        # another mean loss: this micro-batch's mean, weighted by its share (rounds)
        (grad,) = torch.autograd.grad(fn(x, labels) * (len(x) / batch), x)
        return grad


class DeferredGrads(TorchFunctionMode):
    """Dense parameters' gradients once per batch instead of once per micro-batch.

    Inside `with self:` the parameters do not require grad, so a micro-batch's backward
    computes activation gradients only. Uses this mode intercepts keep their operands:
    `F.linear(x, W, b)` (nn.Linear, DCN's cross kernels) keeps `x` and the output's
    gradient; `t + p` with `p` broadcast over leading dims (DCN's cross bias) keeps the
    output's gradient. `accumulate` then computes, for the whole batch in data order,
    `g^T x` and `g.sum(0)`: what autograd computes in the plain loop. Any other use of a
    parameter gets a per-micro-batch leaf whose gradients are summed (within rounding; named
    in `inexact`).
    """

    _ADDS = {torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__, torch.add}

    def __init__(self, params: dict[str, torch.nn.Parameter]) -> None:
        super().__init__()
        self._params = {id(p): (n, p) for n, p in params.items()}
        # per micro-batch, its uses in order: (kind, param(s), kept input, [output grad])
        self._uses: list[list[tuple]] = []
        self.inexact: set[str] = set()

    def __enter__(self):
        for _, p in self._params.values():
            p.requires_grad_(False)
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)  # first: the flags below are not a use
        for _, p in self._params.values():
            p.requires_grad_(True)
        return out

    def _keep(self, kind: str, params: tuple, kept, out: torch.Tensor) -> torch.Tensor:
        grads: list[torch.Tensor] = []
        self._uses[-1].append((kind, params, kept, grads))
        out.register_hook(grads.append)
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            # (an input without grad would leave no output gradient to keep: a leaf then)
            if id(w) in self._params and (b is None or id(b) in self._params) and x.requires_grad:
                out = func(x, w, b)  # under autocast: in its dtype, x cast to it
                return self._keep("linear", (w, b), x.detach().to(out.dtype), out)
        elif func in self._ADDS and len(args) == 2 and not kwargs:
            for p, t in (args[1], args[0]), (args[0], args[1]):
                if id(p) in self._params and _broadcasts_over_samples(p, t):
                    return self._keep("add", (p,), None, func(*args))
        if any(id(a) in self._params for a in _tensors(args, kwargs)):
            args, kwargs = tree_map(self._leaf, (args, kwargs))
        return func(*args, **kwargs)

    def _leaf(self, a):
        if not isinstance(a, torch.Tensor) or id(a) not in self._params:
            return a
        name, p = self._params[id(a)]
        self.inexact.add(name)
        leaf = p.detach().requires_grad_()
        leaf.register_hook(lambda g: _add_grad(p, g))
        return leaf

    def start_micro_batch(self) -> None:
        self._uses.append([])

    def accumulate(self, inverse: torch.Tensor | None, batch: int) -> None:
        """Each parameter's gradient over the whole batch: use i of every micro-batch
        together (the same graph runs on each)."""
        uses = [u for u in self._uses if u]
        self._uses = []
        if len({len(u) for u in uses}) > 1:
            raise RuntimeError(
                "pipeline=nested: the dense forward differs between "
                "micro-batches; its parameter gradients cannot be joined"
            )
        for same in zip(*uses, strict=True):
            kind, params = same[0][0], same[0][1]
            if not all(u[3] for u in same):  # did not reach the loss: no gradient
                continue
            g = torch.cat([u[3][0] for u in same])
            if kind == "linear":
                w, b = params
                x = torch.cat([u[2] for u in same])
                x, g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
                if inverse is not None and len(x) == batch:
                    x, g = x[inverse], g[inverse]
                # what autograd computes for F.linear's weight, g^T x with the operands in
                # that order (x^T g transposed rounds differently at some shapes, e.g. 80
                # inputs to 8 outputs: DeepFM's deep layer), in the dtype the op ran in;
                # autocast's cast back to the parameter's dtype is `_add_grad`'s
                _add_grad(w, g.t().mm(x))
                if b is not None:
                    _add_grad(b, g.sum(0))
            else:
                (p,) = params
                if inverse is not None and len(g) == batch:
                    g = g[inverse]
                _add_grad(p, g.sum_to_size(p.shape))


def _broadcasts_over_samples(p: torch.Tensor, t) -> bool:
    """`t + p` adds `p` to every leading index of `t` (a bias over the batch), and `t`
    carries a gradient."""
    return (
        isinstance(t, torch.Tensor)
        and t.requires_grad
        and t.dim() > p.dim()
        and t.shape[-p.dim() :] == p.shape
    )


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def _add_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    # in the parameter's layout and dtype, as autograd leaves it (a collective reads storage
    # order; under autocast the gradient passes back through the cast of the parameter)
    g = g.to(p.dtype).contiguous()
    p.grad = g if p.grad is None else p.grad + g
