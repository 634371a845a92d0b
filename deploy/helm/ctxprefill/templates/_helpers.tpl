{{/* Names: the release's ("ctxprefill" for `helm install ctxprefill`), at most 63 characters. */}}
{{- define "ctxprefill.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ctxprefill.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Pods and Services are found by these. */}}
{{- define "ctxprefill.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ctxprefill.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "ctxprefill.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "ctxprefill.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Settings the chart derives from other values: refused in .Values.settings. */}}
{{- define "ctxprefill.ownedSettings" -}}
CTXPREFILL_HOST CTXPREFILL_METRICS_HOST CTXPREFILL_NUM_SHARDS CTXPREFILL_SHARD_INDEX CTXPREFILL_MODEL CTXPREFILL_AUTH_TOKEN_FILE CTXPREFILL_AUTH_TOKEN CTXPREFILL_TLS_CERT CTXPREFILL_TLS_KEY CTXPREFILL_TLS_CLIENT_CA CTXPREFILL_ALLOW_INSECURE CTXPREFILL_SHARED_MEMORY CTXPREFILL_PORT CTXPREFILL_METRICS_PORT
{{- end }}
