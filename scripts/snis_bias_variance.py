"""The bias and variance of KV eviction estimators (paper 003 Fig. 2), as a command line: ``python -m
evaluation.studies.snis_bias_variance`` (its docstring says more)."""

from evaluation.studies.snis_bias_variance import main

if __name__ == "__main__":
    main()
