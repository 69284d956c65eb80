"""Empirical privacy audits of the federation's real outputs (docs/results/privacy-audit.md): canary devices,
each adversary's view, epsilon lower bounds from many runs and Andrew et al.'s one-run estimate."""

from .bounds import (
    AuditBound,
    clopper_pearson_upper,
    epsilon_from_rates,
    epsilon_lower_bound,
    gaussian_pair_epsilon,
)
from .canary import ADVERSARIES, AuditFederation
from .runs import OneRunEstimate, TrialAudit, audit_trials, one_run_estimate

__all__ = ["ADVERSARIES", "AuditBound", "AuditFederation", "OneRunEstimate", "TrialAudit", "audit_trials",
           "clopper_pearson_upper", "epsilon_from_rates", "epsilon_lower_bound", "gaussian_pair_epsilon",
           "one_run_estimate"]
