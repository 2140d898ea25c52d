{{/* Labels on every object, as deploy/kustomization.yaml sets them. */}}
{{- define "pko-rs.labels" -}}
app.kubernetes.io/part-of: pko-rs
{{- end -}}

{{/* "true" when the scope is namespaces; fails on an unknown mode. */}}
{{- define "pko-rs.namespaced" -}}
{{- if eq .Values.scope.mode "namespaces" -}}true
{{- else if ne .Values.scope.mode "cluster" -}}{{ fail (printf "scope.mode must be cluster or namespaces, not %q" .Values.scope.mode) }}
{{- end -}}
{{- end -}}

{{/* The watched namespaces, comma-separated (namespaces scope). */}}
{{- define "pko-rs.watchNamespaces" -}}
{{- if .Values.scope.namespaces -}}{{ join "," .Values.scope.namespaces }}{{- else -}}{{ .Release.Namespace }}{{- end -}}
{{- end -}}

{{/* "true" when the admission webhook runs. */}}
{{- define "pko-rs.webhook" -}}
{{- if and .Values.webhook.enabled (not (include "pko-rs.namespaced" .)) -}}true{{- end -}}
{{- end -}}
