{{/* The Gateway API Inference Extension (gateway.inferencePool): which pools become InferencePools, and names. */}}

{{/* The pools a Gateway routes to, as a JSON list of names: the regular pools with weight (a long-context pool
     takes only what no regular pool can, which a Gateway cannot tell). */}}
{{- define "kvfleet.gatewayPools" -}}
{{- $out := list -}}
{{- range $pool, $p := include "kvfleet.pools" . | fromJson -}}
{{- if and (not $p.longContext) (gt (int $p.weight) 0) -}}
{{- $out = append $out $pool -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{- define "kvfleet.inferencePoolName" -}}
{{- include "kvfleet.engineName" . -}}
{{- end -}}

{{- define "kvfleet.eppName" -}}
{{- printf "%s-epp-%s" (include "kvfleet.fullname" .root) .pool -}}
{{- end -}}

{{/* name -> priority of the pool's InferenceObjectives: the tenants' priorities, then gateway.inferencePool.objectives. */}}
{{- define "kvfleet.objectives" -}}
{{- $out := dict -}}
{{- $tenants := dig "tenants" "config" "tenants" dict .root.Values.router -}}
{{- range $name, $t := $tenants -}}
{{- if and (kindIs "map" $t) (hasKey $t "priority") -}}
{{- $_ := set $out $name (int $t.priority) -}}
{{- end -}}
{{- end -}}
{{- range $name, $priority := .root.Values.gateway.inferencePool.objectives -}}
{{- $_ := set $out $name (int $priority) -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* The pool's InferenceObjectives as YAML documents: rendered as objects, and given to its picker as a file. */}}
{{- define "kvfleet.objectiveDocs" -}}
{{- $poolName := include "kvfleet.inferencePoolName" . -}}
{{- range $name, $priority := include "kvfleet.objectives" . | fromJson }}
---
apiVersion: llm-d.ai/v1alpha2
kind: InferenceObjective
metadata:
  name: {{ printf "%s-%s" $poolName $name | trunc 63 | trimSuffix "-" }}
  labels:
    {{- include "kvfleet.labels" $.root | nindent 4 }}
    app.kubernetes.io/component: epp
    kvfleet.dev/pool: {{ $.pool }}
spec:
  poolRef:
    group: inference.networking.k8s.io
    kind: InferencePool
    name: {{ $poolName }}
  priority: {{ int $priority }}
{{- end }}
{{- end -}}
