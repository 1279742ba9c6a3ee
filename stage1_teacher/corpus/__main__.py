"""python -m stage1_teacher.corpus data.jsonl --text-field text   # prints counts"""

import sys

from stage1_teacher.corpus.rows import main

main(sys.argv[1:])
