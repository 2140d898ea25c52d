{{/* The chart's name (nameOverride), the stem of every object name. */}}
{{- define "pko-rs.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 45 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's stem of every object name, by Helm's usual rules: fullnameOverride, else
the release name when it holds the chart's name, else <release>-<name>. Release "pko-rs" gives
"pko-rs", so its objects keep deploy/'s names. At most 45 characters, so the longest suffix
(-grafana-dashboard) still makes a 63-character DNS label. */}}
{{- define "pko-rs.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "pko-rs.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The operator's name: its Deployment, ServiceAccount, ClusterRole and the other objects
named after it (pko-rs-operator for release pko-rs). */}}
{{- define "pko-rs.operator" -}}
{{- include "pko-rs.fullname" . }}-operator
{{- end -}}

{{/* The application's name label (app.kubernetes.io/name): pko-rs-operator by default, the
label deploy/ and deploy/examples select the operator's pods by. */}}
{{- define "pko-rs.appName" -}}
{{- include "pko-rs.name" . }}-operator
{{- end -}}

{{/* The labels that select this release's operator pods: by name and instance, so the
selectors of one release never match another's pods. */}}
{{- define "pko-rs.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pko-rs.appName" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels on every object: the recommended app.kubernetes.io set and helm.sh/chart, and
part-of as deploy/kustomization.yaml sets it. */}}
{{- define "pko-rs.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "pko-rs.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pko-rs
{{- end -}}

{{/* The operator's image: [registry/]repository:tag, the tag defaulting to the chart's
appVersion. */}}
{{- define "pko-rs.image" -}}
{{- $i := .Values.image -}}
{{- $repository := $i.repository -}}
{{- with $i.registry }}{{ $repository = printf "%s/%s" (trimSuffix "/" .) $repository }}{{ end -}}
{{- printf "%s:%s" $repository (default .Chart.AppVersion $i.tag) -}}
{{- end -}}

{{/* The leader-election Lease's name: leaderElection.id, else <fullname>-operator. */}}
{{- define "pko-rs.leaseName" -}}
{{- default (include "pko-rs.operator" .) .Values.leaderElection.id -}}
{{- end -}}

{{/* "true" when cert-manager issues the webhook's certificate (webhook on). */}}
{{- define "pko-rs.certManager" -}}
{{- if and (include "pko-rs.webhook" .) .Values.webhook.certManager.enabled -}}true{{- end -}}
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

{{/* In webhook.certManager mode, the annotation that has cert-manager's CA injector fill the
webhook configuration's caBundle from the webhook's Certificate. */}}
{{- define "pko-rs.injectCA" -}}
{{- if include "pko-rs.certManager" . -}}
annotations:
  cert-manager.io/inject-ca-from: {{ printf "%s/%s-webhook" .Release.Namespace (include "pko-rs.fullname" .) }}
{{- end -}}
{{- end -}}
