{{/* Names, labels and the merged engine pools. */}}

{{- define "kvfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 35 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-kvfleet, at most 35 characters, so that "<fullname>-engine-<pool of 20>" fits 63. */}}
{{- define "kvfleet.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 35 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 35 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 35 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvfleet.labels" -}}
{{ include "kvfleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvfleet.engineName" -}}
{{- printf "%s-engine-%s" (include "kvfleet.fullname" .root) .pool -}}
{{- end -}}

{{- define "kvfleet.routerName" -}}
{{- printf "%s-router" (include "kvfleet.fullname" .) -}}
{{- end -}}

{{- define "kvfleet.redisName" -}}
{{- printf "%s-redis" (include "kvfleet.fullname" .) -}}
{{- end -}}

{{/* Selector of one pool's engine pods (the version label stays out: selectors are immutable). */}}
{{- define "kvfleet.engineSelectorLabels" -}}
{{ include "kvfleet.selectorLabels" .root }}
app.kubernetes.io/component: engine
kvfleet.dev/pool: {{ .pool }}
{{- end -}}

{{- define "kvfleet.routerSelectorLabels" -}}
{{ include "kvfleet.selectorLabels" . }}
app.kubernetes.io/component: router
{{- end -}}

{{- define "kvfleet.internalTokenSecret" -}}
{{- default (printf "%s-internal-token" (include "kvfleet.fullname" .)) .Values.internalToken.existingSecret -}}
{{- end -}}

{{- define "kvfleet.tenantsSecret" -}}
{{- default (printf "%s-tenants" (include "kvfleet.fullname" .)) .Values.router.tenants.existingSecret -}}
{{- end -}}

{{- define "kvfleet.usesChartRedis" -}}
{{- if and .Values.router.tenants.enabled (eq .Values.redis.mode "chart") -}}true{{- end -}}
{{- end -}}

{{/* Image reference: repository:tag, the tag defaulting to the chart's appVersion. */}}
{{- define "kvfleet.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{/* Deep merge of two maps, "over" winning (false, 0 and "" too), maps merged key by key, lists replaced;
     spelled out rather than sprig's mergeOverwrite, whose handling of empty values changed between versions.
     Returns JSON (include can only return text). */}}
{{- define "kvfleet.deepMerge" -}}
{{- $out := deepCopy .base -}}
{{- range $k, $v := .over -}}
{{- $cur := index $out $k -}}
{{- if and (kindIs "map" $v) (kindIs "map" $cur) -}}
{{- $_ := set $out $k (include "kvfleet.deepMerge" (dict "base" $cur "over" $v) | fromJson) -}}
{{- else -}}
{{- $_ := set $out $k $v -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* The enabled pools, each merged over engineDefaults, as JSON: {"stable": {...}, ...}.
     Use: $pools := include "kvfleet.pools" . | fromJson */}}
{{- define "kvfleet.pools" -}}
{{- $out := dict -}}
{{- range $name, $pool := .Values.pools -}}
{{- if or (not (hasKey $pool "enabled")) $pool.enabled -}}
{{- $merged := include "kvfleet.deepMerge" (dict "base" $.Values.engineDefaults "over" $pool) | fromJson -}}
{{- $_ := set $out $name $merged -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* terminationGracePeriodSeconds of one pool: above drain timeout + preStop sleep. */}}
{{- define "kvfleet.engineGracePeriod" -}}
{{- $p := .p -}}
{{- $floor := add (int $p.drainTimeoutSeconds) (int $p.preStopSleepSeconds) -}}
{{- if kindIs "invalid" $p.terminationGracePeriodSeconds -}}
{{- add $floor 15 -}}
{{- else if le (int $p.terminationGracePeriodSeconds) $floor -}}
{{- fail (printf "pools.%s.terminationGracePeriodSeconds (%d) must exceed drainTimeoutSeconds + preStopSleepSeconds (%d), or the engine is killed before its streams finish" .pool (int $p.terminationGracePeriodSeconds) $floor) -}}
{{- else -}}
{{- int $p.terminationGracePeriodSeconds -}}
{{- end -}}
{{- end -}}

{{/* Volume for a model source ({type, pvc, hostPath, download}), for any type but bundled; the download
     type mounts the pool's cache PVC. */}}
{{- define "kvfleet.modelVolume" -}}
{{- $s := .source -}}
- name: model
{{- if eq $s.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required (printf "%s.modelSource.pvc.claimName is required with modelSource.type pvc" .where) $s.pvc.claimName }}
    readOnly: true
{{- else if eq $s.type "hostPath" }}
  hostPath:
    path: {{ required (printf "%s.modelSource.hostPath.path is required with modelSource.type hostPath" .where) $s.hostPath.path }}
    type: {{ $s.hostPath.type }}
{{- else if eq $s.type "download" }}
  persistentVolumeClaim:
    claimName: {{ default (printf "%s-model" .name) $s.download.cache.existingClaim }}
{{- end }}
{{- end -}}

{{- define "kvfleet.modelVolumeMount" -}}
{{- $s := .source -}}
- name: model
  mountPath: {{ $s.mountPath }}
  readOnly: true
{{- if and (eq $s.type "pvc") $s.pvc.subPath }}
  subPath: {{ $s.pvc.subPath }}
{{- end }}
{{- end -}}

{{/* A series' name in the custom metrics API: prometheus-adapter renames the engines' `vllm:x` / `sglang:x` to
     `vllm_x` / `sglang_x` (files/prometheus-adapter-rules.yaml): metric names are URL path segments there. */}}
{{- define "kvfleet.customMetricName" -}}{{ replace ":" "_" . }}{{- end -}}

{{/* PromQL of one pool's signal summed over its pods (KEDA divides by the replica count: AverageValue). The
     labels namespace and service are those the Prometheus Operator puts on targets of a ServiceMonitor. */}}
{{- define "kvfleet.poolSumQuery" -}}
{{- printf "sum(%s{namespace=%q,service=%q})" .series .root.Release.Namespace .service -}}
{{- end -}}

{{/* "true" when a pool scales on the replicas the routers say its latency targets need
     (kvfleet_router_pool_desired_replicas): autoscaling.latencyTargets, or with it null, when the pool sets a target. */}}
{{- define "kvfleet.latencyScaling" -}}
{{- $l := .p.autoscaling.latencyTargets -}}
{{- if kindIs "invalid" $l -}}
{{- if or (not (kindIs "invalid" .p.sloTtftMs)) (not (kindIs "invalid" .p.sloTpotMs)) }}true{{ end -}}
{{- else if $l }}true{{ end -}}
{{- end -}}

{{/* autoscaling/v2 behavior shared by HPA and KEDA: scale up fast, scale down one pod at a time after a long
     stabilization window. */}}
{{- define "kvfleet.scalingBehavior" -}}
scaleUp:
  stabilizationWindowSeconds: 0
  selectPolicy: Max
  policies:
    - {type: Pods, value: 2, periodSeconds: 60}
scaleDown:
  stabilizationWindowSeconds: {{ int .Values.autoscaling.scaleDownStabilizationSeconds }}
  selectPolicy: Min
  policies:
    - {type: Pods, value: 1, periodSeconds: 120}
{{- end -}}
