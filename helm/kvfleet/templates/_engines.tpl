{{/* What differs between the engines a pool can run (kvfleet, vllm, sglang): checks, image, command, args, env,
     readiness path and metric names. Each takes (dict "root" $ "pool" NAME "p" MERGED-POOL). */}}

{{- define "kvfleet.engines" -}}kvfleet vllm sglang{{- end -}}

{{/* The pool's engine, checked (the schema's enum says the same; this also holds with schema validation off). */}}
{{- define "kvfleet.engine" -}}
{{- $engine := toString (default "kvfleet" .p.engine) -}}
{{- if not (has $engine (splitList " " (include "kvfleet.engines" .))) -}}
{{- fail (printf "pools.%s.engine: must be one of kvfleet, vllm, sglang, got %q" .pool $engine) -}}
{{- end -}}
{{- $engine -}}
{{- end -}}

{{/* The model name the pool serves (--served-model-name): its own servedModelName, else the top-level one. */}}
{{- define "kvfleet.servedModel" -}}
{{- default .root.Values.servedModelName .p.servedModelName -}}
{{- end -}}

{{/* The model `helm test` and NOTES ask for: the top-level servedModelName when a regular pool with weight serves
     it, else the first such pool's (by name). */}}
{{- define "kvfleet.testModel" -}}
{{- $served := list -}}
{{- range $pool, $p := include "kvfleet.pools" . | fromJson -}}
{{- if and (not $p.longContext) (gt (int $p.weight) 0) -}}
{{- $served = append $served (include "kvfleet.servedModel" (dict "root" $ "pool" $pool "p" $p)) -}}
{{- end -}}
{{- end -}}
{{- if or (has .Values.servedModelName $served) (not $served) }}{{ .Values.servedModelName }}{{ else }}{{ first $served }}{{ end -}}
{{- end -}}

{{/* Refuses a pool its engine cannot run, naming the field. */}}
{{- define "kvfleet.checkEngine" -}}
{{- $engine := include "kvfleet.engine" . -}}
{{- $p := .p -}}
{{- $raw := default dict (index .root.Values.pools .pool) -}}
{{- if ne $engine "kvfleet" -}}
{{- if lt (int $p.gpus) 1 -}}
{{- fail (printf "pools.%s.gpus: a %s pool needs at least 1 GPU (its tensor-parallel size is the pod's GPUs), got %d" .pool $engine (int $p.gpus)) -}}
{{- end -}}
{{- if eq $p.modelSource.type "bundled" -}}
{{- fail (printf "pools.%s.modelSource.type: bundled is the model inside kvfleet's engine image; a %s pool reads its model from a volume (pvc, hostPath or download)" .pool $engine) -}}
{{- end -}}
{{- if hasKey $raw "extraArgs" -}}
{{- fail (printf "pools.%s.extraArgs are `kvfleet engine` flags; give %s's flags in pools.%s.%s.extraArgs" .pool $engine .pool $engine) -}}
{{- end -}}
{{- if and (eq $engine "vllm") (not (kindIs "invalid" .root.Values.hashSeed)) (gt (int64 .root.Values.hashSeed) 4294967295) -}}
{{- fail (printf "hashSeed: vLLM pools (pools.%s) take it as PYTHONHASHSEED, which must be at most 4294967295" .pool) -}}
{{- end -}}
{{- end -}}
{{- with $p.routerTokenizer -}}
{{- $src := $.root.Values.router.modelSource -}}
{{- if and (ne $src.type "bundled") (not (hasPrefix (printf "%s/" (trimSuffix "/" $src.mountPath)) .)) -}}
{{- fail (printf "pools.%s.routerTokenizer (%s) must be a path under router.modelSource.mountPath (%s), where routers mount the models" $.pool . $src.mountPath) -}}
{{- end -}}
{{- if and (eq $src.type "bundled") (ne . "smollm2") -}}
{{- fail (printf "pools.%s.routerTokenizer (%s): routers mount no model (router.modelSource.type bundled holds only smollm2); mount the model source into the routers with router.modelSource" $.pool .) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The engine's image: kvfleet's (engineDefaults.image) or the pool's vllm.image / sglang.image. */}}
{{- define "kvfleet.engineImage" -}}
{{- $engine := include "kvfleet.engine" . -}}
{{- toJson (ternary .p.image (index .p $engine | default dict).image (eq $engine "kvfleet")) -}}
{{- end -}}

{{/* The readiness path: kvfleet's /ready turns 200 once the model is loaded and while not draining; vLLM and SGLang
     answer /health once serving. */}}
{{- define "kvfleet.readyPath" -}}
{{- if eq (include "kvfleet.engine" .) "kvfleet" }}/ready{{ else }}/health{{ end -}}
{{- end -}}

{{/* The ZMQ KV-event config of vLLM and SGLang (--kv-events-config): a publisher and a replay socket, bound on every
     interface; routers subscribe to each replica's host (pools file `kv_events`). */}}
{{- define "kvfleet.kvEventsConfig" -}}
{{- $c := dict "publisher" "zmq" "topic" "kv-events" "endpoint" (printf "tcp://*:%d" (int .p.kvEvents.port)) "replay_endpoint" (printf "tcp://*:%d" (int .p.kvEvents.replayPort)) -}}
{{- if eq (include "kvfleet.engine" .) "vllm" }}{{ $_ := set $c "enable_kv_cache_events" true }}{{ end -}}
{{- toJson $c -}}
{{- end -}}

{{/* The pools file's kv_events of a vllm or sglang pool: publisher|replay, {host} being each replica's host. */}}
{{- define "kvfleet.kvEventsEndpoints" -}}
{{- printf "tcp://{host}:%d|tcp://{host}:%d" (int .p.kvEvents.port) (int .p.kvEvents.replayPort) -}}
{{- end -}}

{{/* command (JSON list; empty: the image's entrypoint) */}}
{{- define "kvfleet.engineCommand" -}}
{{- $engine := include "kvfleet.engine" . -}}
{{- if eq $engine "vllm" }}["vllm", "serve"]{{ else if eq $engine "sglang" }}["python3", "-m", "sglang.launch_server"]{{ else }}[]{{ end -}}
{{- end -}}

{{/* LoRA flags of a kvfleet or vllm pool (the same names in both), as YAML list items */}}
{{- define "kvfleet.loraArgs" -}}
{{- $l := .lora | default dict -}}
{{- if or $l.enabled $l.modules }}
- --enable-lora
- --max-loras={{ int ($l.maxLoras | default 1) }}
- --max-lora-rank={{ int ($l.maxLoraRank | default 16) }}
{{- if not (kindIs "invalid" $l.maxCpuLoras) }}
- --max-cpu-loras={{ int $l.maxCpuLoras }}
{{- end }}
{{- if and $l.modules (not $l.routerOnDemand) }}
- --lora-modules
{{- range $name, $path := $l.modules }}
- {{ printf "%s=%s" $name $path | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* args, as a YAML list */}}
{{- define "kvfleet.engineArgs" -}}
{{- $engine := include "kvfleet.engine" . -}}
{{- $p := .p -}}
{{- $root := .root -}}
{{- $served := include "kvfleet.servedModel" . -}}
{{- if eq $engine "kvfleet" }}
- engine
- --model={{ $p.model }}
- --served-model-name={{ $served }}
- --host=0.0.0.0
- --port={{ int $p.port }}
- --require-internal-token
- --drain-timeout={{ int $p.drainTimeoutSeconds }}
{{- if not (kindIs "invalid" $root.Values.hashSeed) }}
- --hash-seed={{ int64 $root.Values.hashSeed }}
{{- end }}
{{- if not (kindIs "invalid" $p.maxContextTokens) }}
- --max-model-len={{ int $p.maxContextTokens }}
{{- end }}
{{- include "kvfleet.loraArgs" $p }}
{{- if $p.deterministic }}
- --deterministic
{{- end }}
{{- range $p.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- else if eq $engine "vllm" }}
- --model={{ $p.model }}
- --served-model-name={{ $served }}
- --host=0.0.0.0
- --port={{ int $p.port }}
- --tensor-parallel-size={{ int $p.gpus }}
{{- if not (kindIs "invalid" $p.maxContextTokens) }}
- --max-model-len={{ int $p.maxContextTokens }}
{{- end }}
{{- if not (kindIs "invalid" $root.Values.hashSeed) }}
- --prefix-caching-hash-algo={{ $p.vllm.prefixCachingHashAlgo }}
{{- end }}
- --enable-prompt-tokens-details
- {{ printf "--kv-events-config=%s" (include "kvfleet.kvEventsConfig" .) | quote }}
{{- include "kvfleet.loraArgs" $p }}
{{- range $p.vllm.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- else }}
- --model-path={{ $p.model }}
- --served-model-name={{ $served }}
- --host=0.0.0.0
- --port={{ int $p.port }}
- --tp-size={{ int $p.gpus }}
- --page-size={{ int $p.sglang.pageSize }}
{{- if not (kindIs "invalid" $p.maxContextTokens) }}
- --context-length={{ int $p.maxContextTokens }}
{{- end }}
- --enable-metrics
- {{ printf "--kv-events-config=%s" (include "kvfleet.kvEventsConfig" .) | quote }}
{{- range $p.sglang.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* env, as a YAML list. Every writable path is under the /cache and /tmp emptyDirs: the root filesystem is
     read-only and the user is not the image's (HOME, XDG and the compilers' caches are moved there). */}}
{{- define "kvfleet.engineEnv" -}}
{{- $engine := include "kvfleet.engine" . -}}
{{- $root := .root -}}
{{- if eq $engine "kvfleet" }}
- name: KVFLEET_INTERNAL_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ include "kvfleet.internalTokenSecret" $root }}, key: {{ $root.Values.internalToken.secretKey }}}
- {name: KVFLEET_CACHE_DIR, value: /cache/kvfleet}
- {name: TRITON_CACHE_DIR, value: /cache/triton}
- {name: HF_HOME, value: /cache/hf}
- {name: HF_HUB_OFFLINE, value: "1"}
{{- else }}
- {name: HOME, value: /cache/home}
- {name: XDG_CACHE_HOME, value: /cache/xdg}
- {name: XDG_CONFIG_HOME, value: /cache/config}
- {name: HF_HOME, value: /cache/hf}
- {name: HF_HUB_OFFLINE, value: "1"}
- {name: TRITON_CACHE_DIR, value: /cache/triton}
- {name: TORCHINDUCTOR_CACHE_DIR, value: /cache/inductor}
- {name: FLASHINFER_WORKSPACE_BASE, value: /cache/flashinfer}
{{- if eq $engine "vllm" }}
- {name: VLLM_CACHE_ROOT, value: /cache/vllm}
- {name: VLLM_CONFIG_ROOT, value: /cache/config/vllm}
- {name: VLLM_NO_USAGE_STATS, value: "1"}
- {name: DO_NOT_TRACK, value: "1"}
{{- if not (kindIs "invalid" $root.Values.hashSeed) }}
# vLLM seeds its first block hash from PYTHONHASHSEED (random per process without it)
- {name: PYTHONHASHSEED, value: {{ int64 $root.Values.hashSeed | toString | quote }}}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The two scaling signals of an engine: its Prometheus series, KV usage (0..1) and waiting requests. kvfleet
     exports vLLM's names; SGLang its own. */}}
{{- define "kvfleet.engineMetrics" -}}
{{- if eq (include "kvfleet.engine" .) "sglang" -}}
{"kvUsage": "sglang:token_usage", "waiting": "sglang:num_queue_reqs"}
{{- else -}}
{"kvUsage": "vllm:kv_cache_usage_perc", "waiting": "vllm:num_requests_waiting"}
{{- end -}}
{{- end -}}
