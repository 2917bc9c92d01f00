"""A policy (a named composition of stages) using an outside stage, benchmarked from Python and from the command
line.

``register_policy(PolicySpec(name, stages, options, description))``: ``stages`` maps each kind to a registered
stage name (kinds the chosen stages require and the policy leaves out get their defaults), ``options`` maps a kind
to its stage's options. Run this file, or use it from any command with ``--plugin``::

    polestar bench --plugin docs/examples/policy_hellinger.py --policies polestar,polestar-hellinger --n 8
"""

from pathlib import Path

import polestar
from polestar.bench.harness import run_bench
from polestar.cli import main

polestar.load_plugin(str(Path(__file__).with_name("drift_hellinger.py")))  # registers drift "hellinger"

polestar.register_policy(polestar.PolicySpec(
    "polestar-hellinger",
    {"refresh": "polestar", "commit": "polestar", "drift": "hellinger"},
    options={"refresh": {"n_clusters": 4, "topk": 2}},
    description="Polestar with the Hellinger drift and 4 clusters (top 2 per layer)",
))


if __name__ == "__main__":
    decoding = dict(gen_length=32, block_length=16, steps=None, temperature=0.0, seed=0, stop_at_eos=True,
                    compile=False)
    result = run_bench("tiny-llada", "arith", ["polestar", "polestar-hellinger"], 4, {}, decoding, batch_size=4,
                       show_progress=False)
    for name, summary in result["summary"].items():
        print(name, f"accuracy={summary['accuracy']:.2f}", f"nfe={summary['nfe']}", summary["stages"]["drift"])
    # the same from the command line: the policy is registered in the command's process by --plugin
    code = main(["bench", "--plugin", __file__, "--policies", "polestar-hellinger", "--n", "2", "--batch-size", "2",
                 "--gen-length", "32", "--block-length", "16", "--quiet"])
    assert code == 0
