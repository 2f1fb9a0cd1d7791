#!/usr/bin/env bash
# One node's share of a multi-node run: `accelerate launch` with c10d rendezvous.
# train.sbatch runs it once per node through srun; by hand, run it on every node with
#   NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=<node 0's address> scripts/slurm/launch_node.sh [train.py flags]
#
#   CONFIG           accelerate config (default accelerate_configs/fsdp.yaml)
#   MIXED_PRECISION  no, bf16 or fp16 for the launcher's --mixed_precision (default: the config's, "no")
#   NNODES           number of nodes (SLURM_NNODES under SLURM)
#   NODE_RANK        this node's index (SLURM_NODEID); c10d assigns the ranks itself (torchrun warns that it
#                    ignores it), accelerate uses it to check the port only on node 0
#   PROCS_PER_NODE   processes per node = GPUs per node (SLURM_GPUS_ON_NODE, else 8)
#   MASTER_ADDR      an address of node 0 that every node can reach
#   MASTER_PORT      a free TCP port on node 0 (default: 15000 + SLURM_JOB_ID % 15000 under SLURM, so two
#                    jobs sharing a head node do not collide, below Linux's ephemeral ports; else 29500)
#   MAX_RESTARTS     times torchrun restarts every rank of the job when one dies (default 0); they resume the last
#                    complete checkpoint (train.sbatch passes --resume_from_checkpoint latest)
#   GLOO_SOCKET_IFNAME  the interface gloo uses (start-up checks, stop-signal agreement); when unset and
#                    NCCL_SOCKET_IFNAME names an interface of this node, that one
set -euo pipefail

: "${CONFIG:=accelerate_configs/fsdp.yaml}"
: "${MIXED_PRECISION:=}"
: "${NNODES:=${SLURM_NNODES:-1}}"
: "${NODE_RANK:=${SLURM_NODEID:-0}}"
: "${PROCS_PER_NODE:=${SLURM_GPUS_ON_NODE:-8}}"
if [ -n "${SLURM_JOB_ID:-}" ]; then : "${MASTER_PORT:=$((15000 + SLURM_JOB_ID % 15000))}"; fi
: "${MASTER_PORT:=29500}"
: "${MASTER_ADDR:?set MASTER_ADDR to an address of node 0}"

# gloo otherwise binds to the address of the host name, which may be the wrong network or a
# loopback address (127.0.1.1) the other nodes cannot reach. NCCL's value may also be a prefix
# or an exclusion list (^docker), which gloo does not read: then set GLOO_SOCKET_IFNAME yourself.
if [ -z "${GLOO_SOCKET_IFNAME:-}" ] && [ -n "${NCCL_SOCKET_IFNAME:-}" ] && [ -e "/sys/class/net/$NCCL_SOCKET_IFNAME" ]; then
  export GLOO_SOCKET_IFNAME="$NCCL_SOCKET_IFNAME"
fi
precision=()
if [ -n "$MIXED_PRECISION" ]; then precision=(--mixed_precision "$MIXED_PRECISION"); fi

# torchrun (inside accelerate launch) forwards SIGTERM to the ranks; add SLURM's warning signal,
# and give the ranks time to finish their step and save before it kills them.
export PET_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
export PET_SHUTDOWN_TIMEOUT="${PET_SHUTDOWN_TIMEOUT:-300}"

exec accelerate launch --config_file "$CONFIG" ${precision[@]+"${precision[@]}"} \
  --num_machines "$NNODES" --num_processes "$((NNODES * PROCS_PER_NODE))" --machine_rank "$NODE_RANK" \
  --rdzv_backend c10d --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" \
  --max_restarts "${MAX_RESTARTS:-0}" train.py "$@"
