"""A privacy fuzzer for keras-dp (issue 44): random programs over the public
API, checked by a sensitivity oracle and an accounting oracle that do not
use keras-dp's accounting, and a refusal oracle for what keras-dp cannot do
exactly. `python -m fuzz.campaign` (make fuzz) runs a campaign."""

from fuzz.grammar import Alias
from fuzz.grammar import Checkpoint
from fuzz.grammar import Ensemble
from fuzz.grammar import Fit
from fuzz.grammar import FitPipeline
from fuzz.grammar import Loop
from fuzz.grammar import Program
from fuzz.grammar import SaveLoad
from fuzz.grammar import Set
from fuzz.grammar import generate
from fuzz.grammar import source
from fuzz.oracles import check
