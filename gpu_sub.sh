set -e
pip install -q --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site:$PWD
F="warn\|backend impl\|use_return_dict"
python bench/diag_host.py --liger --tokens 8x1024 --steps 5 --providers base,fastaf-autograd --profile fastaf-autograd --top 70 2>&1 | grep -v -i "$F" > $OUT/prof-liger-8x1024.txt
tail -5 $OUT/prof-liger-8x1024.txt
