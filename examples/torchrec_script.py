"""A plain TorchRec training script with this project's planner and pipeline in it.

Your own model (its tables at `embeddings`, not DLRM's `sparse_arch`), planned by
`sharding.HybridPlanner` for a cluster file, sharded by TorchRec's DistributedModelParallel,
trained through `pipelines.NestedPipeline` (or the plain loop, `--pipeline plain`: the same
losses, bit for bit), then saved with torch.distributed.checkpoint and loaded back into the
unsharded model, as a user exports it. On 2 CPU ranks:

    torchrun --nproc_per_node 2 examples/torchrec_script.py --out /tmp/example

`--cluster` takes a cluster YAML file or a preset's name (its ranks must be torchrun's);
tests/ranks/test_launch.py runs this script. docs/library.md explains each step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import checkpoint as dcp
from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

import sharding
from pipelines import NestedPipeline

ROWS = [20_000, 5_000, 800, 40]  # one table per feature
DIM, DENSE = 16, 4


class ClickModel(nn.Module):
    """The user's model: logits from dense features and sparse ids."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        tables = [
            EmbeddingBagConfig(
                name=f"t{i}", embedding_dim=DIM, num_embeddings=n, feature_names=[f"f{i}"]
            )
            for i, n in enumerate(ROWS)
        ]
        self.embeddings = EmbeddingBagCollection(tables, device=device)
        self.bottom = nn.Sequential(nn.Linear(DENSE, DIM, device=device), nn.ReLU())
        self.top = nn.Sequential(
            nn.Linear(DIM * (len(ROWS) + 1), 32, device=device),
            nn.ReLU(),
            nn.Linear(32, 1, device=device),
        )

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.embeddings(sparse).values()
        return self.top(torch.cat([self.bottom(dense), pooled], dim=1))


class ClickTrain(nn.Module):
    """The loss around it, shaped as TorchRec's DLRMTrain (what its pipelines drive):
    `model` gives logits, `loss_fn` a mean over samples, forward(Batch) -> (loss, outputs)."""

    def __init__(self, model: ClickModel) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(self, batch: Batch):
        logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss = self.loss_fn(logits, batch.labels.float())
        return loss, (loss.detach(), logits.detach(), batch.labels)


def batches(rank: int, size: int, steps: int):
    """This rank's training batches: skewed ids, labels that depend on them."""
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        ids = [(torch.rand(size, generator=gen) ** 3 * n).long() for n in ROWS]
        dense = torch.randn(size, DENSE, generator=gen)
        labels = ((ids[0] % 7 < 3).float() + dense[:, 0] > 0.5).float()
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(len(ROWS))],
            values=torch.cat(ids),
            lengths=torch.ones(size * len(ROWS), dtype=torch.int32),
        )
        yield Batch(dense_features=dense, sparse_features=sparse, labels=labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="local_cpu2", help="a cluster YAML file or preset")
    parser.add_argument("--batch-size", type=int, default=256, help="samples per rank a step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pipeline", choices=["nested", "plain"], default="nested")
    parser.add_argument("--out", type=Path, required=True, help="losses and the checkpoint")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, device = dist.get_rank(), torch.device("cpu")
    torch.manual_seed(0)  # the same dense layers on every rank

    # --- planning and setup beyond TorchRec's own: these lines ---
    model = ClickTrain(ClickModel(torch.device("meta")))
    sharders = [EmbeddingBagCollectionSharder()]
    plan = sharding.HybridPlanner(args.cluster, batch_size=args.batch_size).collective_plan(
        model, sharders, dist.group.WORLD
    )
    # its paths checked (DMP would leave an unplanned module unsharded); with unequal batch
    # shares each rank's loss weighted by its share
    plan.prepare(model)
    if rank == 0:
        print(f"predicted {plan.est_step_ms:.1f} ms/step (bound {plan.lower_bound_ms:.1f} ms)")
    my_batch = plan.batch_per_rank[rank]
    # ---

    apply_optimizer_in_backward(torch.optim.SGD, model.model.embeddings.parameters(), {"lr": 0.1})
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.1),
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    data = batches(rank, my_batch, args.steps)
    losses = []
    if args.pipeline == "nested":
        pipeline = NestedPipeline(dmp, optimizer, device, micro_batches=4)
        for _ in range(args.steps):
            losses.append(float(pipeline.progress(data)[0]))
    else:  # the plain loop, as TorchRec's examples write it
        for batch in data:
            optimizer.zero_grad()
            loss, _ = dmp(batch)
            loss.backward()
            # the dense gradients averaged over ranks: DMP's DDP does it in backward
            optimizer.step()
            losses.append(float(loss.detach()))

    dcp.save(dmp.state_dict(), checkpoint_id=args.out / "checkpoint")  # every rank its shards
    dist.barrier()
    if rank == 0:  # exported: the whole model, unsharded, for serving or a later script
        plain = ClickTrain(ClickModel(device))
        state = plain.state_dict()
        dcp.load(state, checkpoint_id=args.out / "checkpoint", no_dist=True)
        plain.load_state_dict(state)
        torch.save(plain.state_dict(), args.out / "model.pt")
        print(f"rank 0 losses: {', '.join(f'{x:.4f}' for x in losses[:3])} ... {losses[-1]:.4f}")
        print(f"exported: {args.out / 'model.pt'}")
    (args.out / f"losses_rank{rank}.json").write_text(json.dumps(losses))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
