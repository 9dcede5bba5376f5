"""`python -m recsys.evaluate trainer.resume_from=<checkpoint> [dataset.eval_split=test]`:
evaluate a checkpoint (AUC, log loss, NE) on a held-out split, the whole split unless
`dataset.eval_batches` says otherwise; every other key as `recsys.train` takes it (the same
model, dataset and cluster; any plan that fits the cluster: DCP reshards on load). The
training command with `trainer.mode=evaluate`; an entry module only (see recsys/train.py).
"""

if __name__ == "__main__":
    from recsys.app.train import evaluate_cli

    evaluate_cli(serve_forks=True)  # its ranks start from the stack this process imported
