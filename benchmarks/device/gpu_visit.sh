#!/usr/bin/env bash
# A device-machine visit in two calls of at most 10 minutes each, results under $OUT.
#   bash benchmarks/device/gpu_visit.sh single   # nvidia-h200: gpu tests, generator, trainer MFU
#   bash benchmarks/device/gpu_visit.sh sync     # nvidia-h200-x4: weight sync (0.6B, 1.7B; 1->1, 2->2),
#                                                #   true on-policy cost and trainer MFU on spare GPUs
#   bash benchmarks/device/gpu_visit.sh system   # nvidia-h200-x4: gpu system tests, e2e sync vs async
#                                                #   at staleness 1 and 2
#   bash benchmarks/device/gpu_visit.sh sync2    # nvidia-h200-x2: weight sync 1 -> 1 (1.7B, 0.6B), the gpu tests
#   bash benchmarks/device/gpu_visit.sh system2  # nvidia-h200-x2: e2e sync vs async (staleness 1, 2) on
#                                                #   configs/alphabet_sort_2gpu.toml, then a 40-step run's reward curve
#   bash benchmarks/device/gpu_visit.sh single1  # nvidia-h200 (one GPU): every gpu test that fits, trainer MFU at 1.7B
#   bash benchmarks/device/gpu_visit.sh system1  # nvidia-h200 (one GPU): e2e sync vs async (staleness 1, 2) on
#                                                #   configs/alphabet_sort_1gpu.toml (trainer and vLLM colocated), a 40-step reward curve
#   bash benchmarks/device/gpu_visit.sh learn1   # nvidia-h200 (one GPU): the GPU demo as a user runs it
#                                                #   (configs/alphabet_sort_1gpu.toml), its learning curve with held-out evals
#   bash benchmarks/device/gpu_visit.sh onpolicy1  # nvidia-h200: batch-invariant matmul sweep, vLLM true
#                                                #   on-policy test, its cost at 0.6B
#   bash benchmarks/device/gpu_visit.sh profile1   # nvidia-h200: router vs raw vLLM, and a py-spy profile
#                                                #   of the router path
#   bash benchmarks/device/gpu_visit.sh final_c    # nvidia-h200: trainer throughput at 1.7B, router vs raw
#                                                #   vLLM (3 runs, 0.6B shape)
#   bash benchmarks/device/gpu_visit.sh onpolicy_demo  # nvidia-h200: true on-policy gradients on CUDA, the vLLM
#                                                #   true on-policy test on the demo's model
#   bash benchmarks/device/gpu_visit.sh onpolicy_e2e   # nvidia-h200: 40 async steps of the 1-GPU demo in true
#                                                #   on-policy mode; with PROBE_SETTINGS, where trainer and vLLM part
#                                                #   (onpolicy_probe.py)
#   bash benchmarks/device/gpu_visit.sh onpolicy_final # nvidia-h200: true on-policy gradients, kernel invariance,
#                                                #   the vLLM true on-policy tests, then onpolicy_e2e
#   bash benchmarks/device/gpu_visit.sh cost_06    # nvidia-h200: vLLM true on-policy cost at the 0.6B shape
#                                                #   (generation: best of 3 runs)
#   bash benchmarks/device/gpu_visit.sh cost_17    # nvidia-h200: the same at the 1.7B shape
#   bash benchmarks/device/gpu_visit.sh costs      # nvidia-h200: cost_06, then cost_17
#   bash benchmarks/device/gpu_visit.sh gen_checks # nvidia-h200: the gpu kernel tests, generation_profile.py at 0.6B
#   bash benchmarks/device/gpu_visit.sh serving_a  # nvidia-h200: each true on-policy kernel's batch invariance
#                                                #   (invariance_probe.py), router vs raw vLLM at 1.7B (3 runs)
#   bash benchmarks/device/gpu_visit.sh serving_b  # nvidia-h200: router vs raw vLLM with 2 replicas on the GPU (0.6B)
#   bash benchmarks/device/gpu_visit.sh train_probe  # nvidia-h200: the trainer attention's gradients, where a
#                                                #   trainer step's GPU time goes in each mode (trainer_profile.py)
#   bash benchmarks/device/gpu_visit.sh cost_checks  # nvidia-h200: the gpu kernel tests, trainer profile, matmul
#                                                #   vs cuBLAS, then onpolicy_e2e
#   bash benchmarks/device/gpu_visit.sh onpolicy_tests # nvidia-h200: the vLLM true on-policy tests
#   bash benchmarks/device/gpu_visit.sh gen_profile  # nvidia-h200: where a vLLM generation's GPU time goes,
#                                                #   default vs true on-policy (generation_profile.py), 0.6B and 1.7B
#   bash benchmarks/device/gpu_visit.sh matmul_probe # nvidia-h200: batch-invariant matmul designs (matmul_designs.py)
#   bash benchmarks/device/gpu_visit.sh serving_c  # nvidia-h200: the 1-GPU e2e (sync, async) now and before the
#                                                #   serving-path change: the tree of 1760a73^ in .device/before
#                                                #   (git archive 1760a73^ | tar -x -C .device/before; add the demo's
#                                                #   checkpoint and its config less [eval] as configs/alphabet_sort_1gpu_now.toml),
#                                                #   carried with the call
# Expects vLLM and Monarch importable (PYTHONPATH), as staged by ../shared/device/README.md.
# Jobs confined by CUDA_VISIBLE_DEVICES run side by side on disjoint GPUs.
set -u
export PYTHONUNBUFFERED=1 HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY=1s HYPERACTOR_MESH_GET_ACTOR_STATE_MAX_IDLE=1s TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
step() {  # step NAME SECONDS GPUS CMD...: runs CMD on GPUS with a time limit, logs to $OUT/NAME.log
  local name=$1 limit=$2 gpus=$3; shift 3
  local start=$(date +%s)
  CUDA_VISIBLE_DEVICES=$gpus timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - start ))s" | tee -a "$OUT/summary.txt"
  tail -n 6 "$OUT/$name.log"
}
START=$(mktemp)  # its time marks the results this visit writes
# The examples' envs are imported as rlactors_examples (pyproject's package-dir); without an install, a link.
python -c "import rlactors_examples" 2>/dev/null || {
  mkdir -p /tmp/pkgs && ln -sfn "$PWD/examples" /tmp/pkgs/rlactors_examples && export PYTHONPATH="${PYTHONPATH:-}:/tmp/pkgs"; }
nvidia-smi -L | tee -a "$OUT/summary.txt"
python -c "import torch, vllm, monarch; print('torch', torch.__version__, 'vllm', vllm.__version__)" | tee -a "$OUT/summary.txt"
case "${1:-single}" in
single)
  step gpu_tests 300 0 python -m pytest -m gpu tests -q -x -p no:cacheprovider
  step generator 200 0 python benchmarks/generator_throughput.py --device cuda
  step trainer 240 0 python benchmarks/trainer_throughput.py --device cuda --sizes 0.6b 1.7b \
      --out benchmarks/results/trainer_throughput_h200.md
  ;;
sync)
  step on_policy_cost 420 2 python benchmarks/on_policy_cost.py --device cuda &
  step trainer 300 3 python benchmarks/trainer_throughput.py --device cuda --sizes 1.7b --ckpt-root /tmp/ck \
      --out "$OUT/trainer_throughput_h200.md" &
  step sync_17b_1x1 200 0,1 python benchmarks/weight_sync.py --size 1.7b --trainer-gpus 1 --replicas 1 --iters 5
  step sync_06b_1x1 120 0,1 python benchmarks/weight_sync.py --size 0.6b --trainer-gpus 1 --replicas 1 --iters 5
  wait
  step sync_17b_2x2 200 0,1,2,3 python benchmarks/weight_sync.py --size 1.7b --trainer-gpus 2 --replicas 2 --iters 5
  ;;
system)
  step gpu_tests 330 0,1,2,3 python -m pytest -m gpu tests/test_gpu_system.py -q -p no:cacheprovider
  step e2e 330 0,1,2,3 python benchmarks/e2e_alphabet_sort.py --config configs/alphabet_sort_4gpu.toml --steps 6 \
      --staleness 1 2
  ;;
sync2)
  step gather_test 80 0,1 python -m pytest -m gpu tests/test_gpu_system.py -k gathers -q -p no:cacheprovider --tb=short
  step sync_17b_1x1 170 0,1 python benchmarks/weight_sync.py --size 1.7b --trainer-gpus 1 --replicas 1 --iters 5
  step gpu_tests 210 0,1 python -m pytest -m gpu tests/test_gpu_system.py -k "nccl or agree" -q -p no:cacheprovider --tb=short
  ;;
system2)
  step e2e 320 0,1 python benchmarks/e2e_alphabet_sort.py --config configs/alphabet_sort_2gpu.toml --steps 7 \
      --staleness 1 2
  step reward_run 240 0,1 python examples/alphabet_sort/run.py --config configs/alphabet_sort_2gpu.toml \
      controller.steps=40 controller.checkpoint_every=0 'controller.run_dir="runs/reward_2gpu"'
  cp runs/reward_2gpu/metrics.jsonl runs/reward_2gpu/*.png "$OUT"/ 2>/dev/null
  ;;
single1)
  # tests/test_placement.py imports monarch.job, whose dashboard needs flask: not among the staged wheels
  step gpu_tests 330 0 python -m pytest -m gpu tests -q -p no:cacheprovider --tb=short --ignore=tests/test_placement.py
  step trainer 240 0 python benchmarks/trainer_throughput.py --device cuda --sizes 1.7b --ckpt-root /tmp/ck \
      --out "$OUT/trainer_throughput_h200.md"
  ;;
system1)
  step e2e 330 0 python benchmarks/e2e_alphabet_sort.py --config configs/alphabet_sort_1gpu.toml --steps 13 \
      --staleness 1 2
  step reward_run 240 0 python examples/alphabet_sort/run.py --config configs/alphabet_sort_1gpu.toml \
      controller.steps=40 controller.checkpoint_every=0 'controller.run_dir="runs/reward_1gpu"'
  cp runs/reward_1gpu/metrics.jsonl runs/reward_1gpu/*.png "$OUT"/ 2>/dev/null
  ;;
learn1)
  rm -rf runs/alphabet_sort_1gpu  # a run dir holds one run: a second call on a warm machine starts afresh
  step demo 540 0 python examples/alphabet_sort/run.py --config configs/alphabet_sort_1gpu.toml
  grep -h "^eval of step\|^done\|^eval reward" "$OUT/demo.log" | tee -a "$OUT/summary.txt"
  python benchmarks/learning_curve.py runs/alphabet_sort_1gpu --machine "nvidia-h200 (one H200)" \
      --command "python examples/alphabet_sort/run.py --config configs/alphabet_sort_1gpu.toml" \
      --out benchmarks/results/alphabet_sort_1gpu_learning.md
  cp runs/alphabet_sort_1gpu/metrics.jsonl "$OUT"/alphabet_sort_1gpu_learning_metrics.jsonl
  cp runs/alphabet_sort_1gpu/reward_curve.png "$OUT"/alphabet_sort_1gpu_learning_reward_curve.png
  ;;
onpolicy1)
  step matmul 200 0 python benchmarks/batch_invariant_matmul.py --configs sweep --out "$OUT/matmul.md"
  step vllm_true_test 420 0 python -m pytest -q -x -p no:cacheprovider --tb=short tests/engines/test_vllm_true_on_policy.py
  ;;
onpolicy_cost1)
  step on_policy_cost 560 0 python benchmarks/on_policy_cost.py --device cuda --engines vllm --repeats 1 \
      --train-steps 2 --out "$OUT/on_policy_cost_gpu.md"
  ;;
onpolicy2)
  step matmul 150 0 python benchmarks/batch_invariant_matmul.py --configs sweep --out "$OUT/matmul.md"
  step vllm_true_test 300 0 python -m pytest -q -x -p no:cacheprovider --tb=short tests/engines/test_vllm_true_on_policy.py
  step on_policy_cost 330 0 python benchmarks/on_policy_cost.py --device cuda --engines vllm --repeats 1 \
      --train-steps 2 --out "$OUT/on_policy_cost_gpu.md"
  python -m rlactors.models.tiny /tmp/ck06 --size 0.6b > /dev/null
  VLLM_ENABLE_V1_MULTIPROCESSING=0 step raw_inprocess 150 0 python benchmarks/generator_throughput.py --device cuda \
      --method raw --checkpoint /tmp/ck06
  ;;
onpolicy_demo)
  step grad_tests 150 0 python -m pytest -q -p no:cacheprovider --tb=short -rA -m gpu tests/models/test_model.py \
      tests/models/test_batch_invariant.py -k gradients
  step onpolicy_demo 420 0 python -m pytest -q -p no:cacheprovider --tb=short -rA \
      tests/engines/test_vllm_true_on_policy.py -k demo
  ;;
onpolicy_e2e)
  rm -rf runs/onpolicy_1gpu
  step onpolicy_e2e 170 0 python examples/alphabet_sort/run.py --config configs/alphabet_sort_1gpu.toml \
      model.true_on_policy=true controller.steps=40 controller.checkpoint_every=0 controller.eval_every=0 \
      'controller.run_dir="runs/onpolicy_1gpu"'
  python -c "import json; m = [json.loads(l) for l in open('runs/onpolicy_1gpu/metrics.jsonl')]; \
d = [r.get('loss/logprob_diff/max') for r in m if 'loss/loss' in r]; print('steps', len(d), 'logprob_diff/max per step:', d)" \
      | tee -a "$OUT/summary.txt"
  for f in runs/onpolicy_1gpu/metrics.jsonl runs/onpolicy_1gpu/reward_curve.png; do cp "$f" "$OUT/onpolicy_1gpu_$(basename $f)"; done
  [ -n "${PROBE_SETTINGS:-}" ] && step probe 400 0 python benchmarks/device/onpolicy_probe.py \
      examples/alphabet_sort/warm_checkpoint_gpu $PROBE_SETTINGS
  ;;
onpolicy_final)
  step grad_tests 150 0 python -m pytest -q -p no:cacheprovider --tb=short -rA -m gpu tests/models/test_model.py \
      tests/models/test_batch_invariant.py -k gradients
  step invariance 150 0 python benchmarks/device/invariance_probe.py
  step onpolicy_tests 400 0 python -m pytest -q -p no:cacheprovider --tb=short -rA \
      tests/engines/test_vllm_true_on_policy.py
  bash "$0" onpolicy_e2e
  ;;
serving_a)
  step invariance 150 0 python benchmarks/device/invariance_probe.py
  step generator_17b 420 0 python benchmarks/generator_throughput.py --device cuda --size 1.7b --repeats 3
  ;;
serving_b)
  step generator_2replicas 580 0 python benchmarks/generator_throughput.py --device cuda --size 0.6b --replicas 2
  ;;
serving_c)
  step e2e_now 290 0 python benchmarks/e2e_alphabet_sort.py --config configs/alphabet_sort_1gpu.toml --steps 13
  cp benchmarks/results/e2e_alphabet_sort.md "$OUT/e2e_alphabet_sort_now.md"
  BEFORE=/root/before  # .device/before, carried and copied there
  mkdir -p /tmp/pkgs_before && ln -sfn "$BEFORE/examples" /tmp/pkgs_before/rlactors_examples
  (cd "$BEFORE" && PYTHONPATH="/tmp/site:/tmp/pkgs_before:$BEFORE" step e2e_before 290 0 python \
      benchmarks/e2e_alphabet_sort.py --config configs/alphabet_sort_1gpu_now.toml --steps 13)
  cp "$BEFORE/benchmarks/results/e2e_alphabet_sort.md" "$OUT/e2e_alphabet_sort_before.md"
  ;;
train_probe)
  step attention_grads 200 0 python -m pytest -q -p no:cacheprovider --tb=short -rA \
      tests/engines/test_vllm_true_on_policy.py -k gradients
  step trainer_profile 350 0 python benchmarks/device/trainer_profile.py
  ;;
cost_checks)
  step kernel_tests 200 0 python -m pytest -q -p no:cacheprovider --tb=short -m gpu tests/models
  step trainer_profile 200 0 python benchmarks/device/trainer_profile.py --top 15
  step matmul 150 0 python benchmarks/batch_invariant_matmul.py --out benchmarks/results/batch_invariant_matmul_gpu.md
  bash "$0" onpolicy_e2e
  ;;
onpolicy_tests)
  step onpolicy_tests 560 0 python -m pytest -q -p no:cacheprovider --tb=short -rA \
      tests/engines/test_vllm_true_on_policy.py
  ;;
gen_profile)
  step generation_profile_06 290 0 python benchmarks/device/generation_profile.py --size 0.6b
  step generation_profile_17 290 0 python benchmarks/device/generation_profile.py --size 1.7b
  ;;
matmul_probe)
  step matmul_designs 560 0 python benchmarks/device/matmul_designs.py
  ;;
cost_06)
  step on_policy_cost_06 290 0 python benchmarks/on_policy_cost.py --device cuda --engines vllm --repeats 3 \
      --train-steps 2 --out "$OUT/on_policy_cost_gpu_0.6b.md"
  ;;
cost_17)
  step on_policy_cost_17 290 0 python benchmarks/on_policy_cost.py --device cuda --engines vllm --repeats 3 \
      --train-steps 2 --size 1.7b --out "$OUT/on_policy_cost_gpu_1.7b.md"
  ;;
costs)
  bash "$0" cost_06
  bash "$0" cost_17
  ;;
gen_checks)
  step kernel_tests 150 0 python -m pytest -q -p no:cacheprovider --tb=short -m gpu tests/models
  step generation_profile_06 290 0 python benchmarks/device/generation_profile.py --size 0.6b
  ;;
final_c)
  python -m rlactors.models.tiny /tmp/ck06 --size 0.6b > /dev/null
  step trainer 240 0 python benchmarks/trainer_throughput.py --device cuda --sizes 1.7b --ckpt-root /tmp/ck \
      --out "$OUT/trainer_throughput_h200.md"
  step generator 330 0 python benchmarks/generator_throughput.py --device cuda --checkpoint /tmp/ck06 --size 0.6b
  ;;
profile1)
  python -m rlactors.models.tiny /tmp/ck06 --size 0.6b > /dev/null
  step generator 300 0 python benchmarks/generator_throughput.py --device cuda --checkpoint /tmp/ck06
  step profile 200 0 py-spy record --subprocesses --format raw --rate 100 -o "$OUT/router_profile.txt" -- \
      python benchmarks/generator_throughput.py --device cuda --method router --checkpoint /tmp/ck06
  python benchmarks/device/pyspy_top.py "$OUT/router_profile.txt" > "$OUT/router_profile_top.txt" 2>&1
  rm -f "$OUT/router_profile.txt"
  ;;
esac
# Only the result files this visit changed: a call brings back at most 8 files.
find benchmarks/results -type f -newer "$START" -exec cp -t "$OUT"/ {} +
cat "$OUT/summary.txt"
