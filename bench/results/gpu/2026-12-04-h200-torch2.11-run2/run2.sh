#!/bin/bash
# Device run 2 (2026-12-04): why does a raising op segfault on the GPU machine?
set -u
R=/tmp/r2; mkdir -p $R
export PATH=/usr/local/cuda/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 NVCC_THREADS=2 PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/times.txt; }
{ echo "CXX=${CXX:-unset} CC=${CC:-unset} CUDAHOSTCXX=${CUDAHOSTCXX:-unset}"; which -a c++ g++ gcc; /opt/gcc/bin/g++ --version | head -1
  /usr/bin/g++ --version 2>&1 | head -1; ls /opt/gcc/lib64 2>&1 | grep -E "stdc|gcc_s"; cat /etc/os-release | head -2
  python3 -c "import torch; print(torch.__config__.show())"; } > $R/env.txt 2>&1
for v in B C; do
  mkdir -p /tmp/$v && cp -r csrc slimcomm setup.py pyproject.toml README.md LICENSE /tmp/$v/ 2>/dev/null
done
(cd /tmp/B && SLIMCOMM_SKIP_CUDA=1 MAX_JOBS=5 timeout 150 python3 setup.py build_ext --inplace > $R/buildB.log 2>&1; echo "rcB=$?" >> $R/times.txt) &
(cd /tmp/C && CXX=/usr/bin/g++ CC=/usr/bin/gcc SLIMCOMM_SKIP_CUDA=1 MAX_JOBS=5 timeout 150 python3 setup.py build_ext --inplace > $R/buildC.log 2>&1; echo "rcC=$?" >> $R/times.txt) &
SLIMCOMM_FORCE_CUDA=1 MAX_JOBS=12 timeout 180 python3 setup.py build_ext --inplace > $R/buildA.log 2>&1; echo "rcA=$?" >> $R/times.txt
wait; t builds done
cat > /tmp/snip.py <<'PY'
import torch, slimcomm.ops as o
w = torch.randn(10)
try:
    o.significance_topk(w, w, 11)
except RuntimeError as e:
    print("RAISED OK:", str(e)[:90])
PY
for d in /work/main /tmp/B /tmp/C; do
  (cd $d && timeout 60 python3 -X faulthandler /tmp/snip.py; echo "rc=$?") > $R/throw_$(basename $d).txt 2>&1
done
ldd slimcomm/_C*.so > $R/ldd.txt 2>&1; ldd /tmp/C/slimcomm/_C*.so > $R/lddC.txt 2>&1
t throws done
timeout 100 cuda-gdb -q -batch -ex run -ex bt -ex "info sharedlibrary" --args python3 /tmp/snip.py > $R/gdb.txt 2>&1
t gdb done
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE tests/test_ops_cuda.py tests/test_ops_step_cuda.py \
  tests/test_ops_codec_cuda.py tests/test_cuda_fallbacks.py > $R/test_cuda_xdist.log 2>&1
t xdist done
timeout 70 python3 -m pytest -q -p no:cacheprovider -rfE --tb=long -x tests/test_host_sync.py -k two_processes > $R/host2p.log 2>&1
t host2p done
tar czf $OUT/r2.tgz -C /tmp r2
tail -5 $R/test_cuda_xdist.log; cat $R/times.txt; cat $R/throw_*.txt; head -40 $R/gdb.txt | grep -E "^#|signal" 
