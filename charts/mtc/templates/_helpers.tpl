{{/* Labels on every object; selectors use only name and component, as in manifests/. */}}
{{- define "mtc.labels" -}}
app.kubernetes.io/name: mtc
app.kubernetes.io/part-of: mtc
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{- define "mtc.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "mtc.tokenSecret" -}}
{{ .Values.token.existingSecret | default "mtc-peer-token" }}
{{- end }}

{{- define "mtc.tlsSecret" -}}
{{ .Values.tls.existingSecret | default "mtc-tls" }}
{{- end }}

{{- define "mtc.coordinatorHost" -}}
mtc-coordinator.{{ .Release.Namespace }}.svc
{{- end }}

{{- define "mtc.coordinatorURL" -}}
{{ ternary "https" "http" .Values.tls.enabled }}://{{ include "mtc.coordinatorHost" . }}:8471
{{- end }}

{{- define "mtc.pluginDir" -}}
{{ .Values.kubeletDir }}/plugins/{{ .Values.driverName }}
{{- end }}
