"""``arbor eval``: the quality replay. Fixed sample sets run on a baseline and a candidate
(two engine settings, weight formats, or two servers), compared side by side, with gates.

    from runtime.eval.run import run_eval
    from runtime.eval.samples import load_samples
    from runtime.eval.targets import EngineTarget

    report = run_eval(EngineTarget({}), EngineTarget({"kv_cache_dtype": "int8"}), load_samples(),
                      {"min_agreement": 0.97})
    print(report.table()); report.passed

Modules: ``samples`` (the sets), ``targets`` (engine or server), ``replay`` (the
measures), ``report`` (scores, gates, table, JSON), ``run``, ``command`` (the CLI).
This package's ``__init__`` imports nothing, so ``arbor``'s parser stays torch-free.
"""
