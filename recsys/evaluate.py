"""`python -m recsys.evaluate trainer.resume_from=<checkpoint> [dataset.eval_split=test]`:
evaluate a checkpoint (AUC, log loss, NE) on a held-out split, the whole split unless
`dataset.eval_batches` says otherwise; every other key as `recsys.train` takes it (the same
model, dataset and cluster; any plan that fits the cluster: DCP reshards on load). The
training command with `trainer.mode=evaluate`; an entry module only (see recsys/train.py).
"""

if __name__ == "__main__":
    from recsys.app.train import evaluate_cli
    from recsys.launch import serve_forks_from_here

    serve_forks_from_here()  # its ranks start from the stack this process imported
    evaluate_cli()
