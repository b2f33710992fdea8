{{/* The chart's name: the app.kubernetes.io/name label. */}}
{{- define "nodelb.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Name of every object: the release name, or release-nodelb when it does not contain "nodelb". */}}
{{- define "nodelb.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "nodelb.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* What selects the agent's pods (immutable in a DaemonSet: never add to it). */}}
{{- define "nodelb.selectorLabels" -}}
app.kubernetes.io/name: {{ include "nodelb.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "nodelb.labels" -}}
{{ include "nodelb.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- if .Values.helmLabels }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}
{{- end -}}

{{- define "nodelb.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/* The port of config.http-addr (host:port, [v6]:port). */}}
{{- define "nodelb.healthPort" -}}
{{- $addr := index .Values.config "health-addr" | default "0.0.0.0:9471" | toString -}}
{{- $addr | splitList ":" | last -}}
{{- end -}}

{{/* The authenticated metrics port, empty when config.metrics-addr is null. */}}
{{- define "nodelb.metricsPort" -}}
{{- with index .Values.config "metrics-addr" -}}
{{- . | toString | splitList ":" | last -}}
{{- end -}}
{{- end -}}

{{/* The controller's name: its Deployment, ServiceAccount and roles. */}}
{{- define "nodelb.controllerName" -}}
{{- printf "%s-controller" (include "nodelb.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* What selects the controller's pods: never the DaemonSet's (its name label differs). */}}
{{- define "nodelb.controllerSelectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-controller" (include "nodelb.name" .) | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "nodelb.controllerLabels" -}}
{{ include "nodelb.controllerSelectorLabels" . }}
app.kubernetes.io/component: controller
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- if .Values.helmLabels }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}
{{- end -}}

{{/* config.* as NODELB_<FLAG> variables: the node agents and the controller get the same ones
(each reads those of its own flags), so both decide with the same policy. */}}
{{- define "nodelb.configEnv" -}}
{{- range $flag, $value := .Values.config }}
{{- if not (kindIs "invalid" $value) }}
- name: {{ printf "NODELB_%s" ($flag | upper | replace "-" "_") }}
  value: {{ if kindIs "slice" $value }}{{ join "," $value | quote }}{{ else }}{{ $value | toString | quote }}{{ end }}
{{- end }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The node agents' ServiceAccount as a username (what the admission policy matches). */}}
{{- define "nodelb.nodeUser" -}}
{{- printf "system:serviceaccount:%s:%s" .Release.Namespace (include "nodelb.fullname" .) -}}
{{- end -}}
