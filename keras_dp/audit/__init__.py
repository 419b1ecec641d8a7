"""Privacy auditing: empirical lower bounds on the epsilon of one training run.

An audit attacks a private training run and turns the attack's success into
a statistically valid LOWER bound on epsilon: if the run were
(epsilon, delta)-DP for a smaller epsilon, an attack this successful would
happen with probability below the significance level. A lower bound far
below the claimed epsilon is normal (the attack, not the mechanism, is weak);
a lower bound ABOVE the claimed epsilon means the implementation or its
accounting is broken. It is never an upper bound: it cannot show that a run
is private.

The one-run audit (Steinke, Nasr & Jagielski, NeurIPS 2023) needs a single
training run: m canaries are each included in the private training set with
probability 1/2, every canary gets a score after training, and the auditor
guesses "included" for the highest scores and "excluded" for the lowest.
Canaries are ordinary members of the private training set: they are clipped,
noised and accounted like every other example, and nothing trains on them
outside the private step.

* `GradientCanaries` (white-box): canary example j has the gradient
  `-s * e_j` (s >= the clipping norm) on coordinate j of an extra canary
  weight that no other example touches; its score is that coordinate's total
  update. This is the strongest attack on DP-SGD.
* `ExampleCanaries` (black-box): given examples (mislabeled, or
  out-of-distribution inputs), scored by minus their loss after training.

`audit_training` runs the whole audit on a model; `one_run_audit` and
`loss_threshold_attack` are the statistics alone, for scores of your own.

Modules: `statistics` (the bounds; numpy and scipy only), `canaries`,
`audits` (`audit_training`) and `builtin_task` (`keras-dp audit`'s task).
"""

from keras_dp.audit.audits import AuditResult
from keras_dp.audit.audits import audit_training
from keras_dp.audit.builtin_task import CANARY_KINDS
from keras_dp.audit.builtin_task import FASHION_MNIST_DIR
from keras_dp.audit.builtin_task import audit_builtin_task
from keras_dp.audit.canaries import ExampleCanaries
from keras_dp.audit.canaries import GradientCanaries
from keras_dp.audit.statistics import DEFAULT_GUESS_FRACTIONS
from keras_dp.audit.statistics import MembershipInferenceResult
from keras_dp.audit.statistics import OneRunResult
from keras_dp.audit.statistics import clopper_pearson
from keras_dp.audit.statistics import loss_threshold_attack
from keras_dp.audit.statistics import one_run_audit
from keras_dp.audit.statistics import one_run_epsilon_lower_bound
from keras_dp.audit.statistics import one_run_p_value

__all__ = [
    "AuditResult", "CANARY_KINDS", "DEFAULT_GUESS_FRACTIONS", "ExampleCanaries",
    "FASHION_MNIST_DIR", "GradientCanaries", "MembershipInferenceResult", "OneRunResult",
    "audit_builtin_task", "audit_training", "clopper_pearson", "loss_threshold_attack",
    "one_run_audit", "one_run_epsilon_lower_bound", "one_run_p_value",
]
