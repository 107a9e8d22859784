"""`specdecode` as before self-drafts read a restricted LM head: every self-draft's head
covers the whole vocabulary, with profiles (T(n), layer-skip) cached apart in /tmp/profB so
that they do not replace the default ones (BENCHMARKS.md section 8):
`python benchmarks/whole_vocab.py bench ...` takes `specdecode`'s arguments."""

import sys
from specdecode.models import native
from specdecode import profile
native.DRAFT_VOCAB = 10 ** 9  # the whole vocabulary: the state before the restricted head
profile.PROFILE_DIR = __import__("pathlib").Path("/tmp/profB")
from specdecode.cli import main
sys.exit(main(sys.argv[1:]))
