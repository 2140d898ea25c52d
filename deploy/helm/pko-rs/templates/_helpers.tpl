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

{{/* The ranges tenants' URLs never reach, comma-separated (--egress-deny-cidr); fails when
neither the private ranges nor the cluster's own are denied. */}}
{{- define "pko-rs.egressDenyCIDRs" -}}
{{- $e := .Values.egress -}}
{{- $cidrs := list -}}
{{- if $e.denyPrivateRanges -}}
{{- $cidrs = concat $cidrs (list "10.0.0.0/8" "172.16.0.0/12" "192.168.0.0/16" "100.64.0.0/10" "fc00::/7") -}}
{{- else if not (and $e.serviceCIDRs $e.podCIDRs) -}}
{{- fail "egress.serviceCIDRs and egress.podCIDRs must both be set when egress.denyPrivateRanges is false: tenants' URLs would reach the cluster's Services and Pods (docs/operations.md, Egress, says how to find them)" -}}
{{- end -}}
{{- $cidrs = concat $cidrs (default list $e.serviceCIDRs) (default list $e.podCIDRs) (default list $e.extraDenyCIDRs) -}}
{{- join "," (uniq $cidrs) -}}
{{- end -}}

{{/* The metrics port's name: https-metrics when served securely. */}}
{{- define "pko-rs.metricsPort" -}}
{{- if .Values.metricsSecure -}}https-metrics{{- else -}}http-metrics{{- end -}}
{{- end -}}
