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

{{- /* Per-node identity: on with the API server (coordinator.kube) unless nodeIdentity.enabled is false. */}}
{{- define "mtc.nodeIdentity" -}}
{{- if and .Values.coordinator.kube .Values.nodeIdentity.enabled }}true{{- end }}
{{- end }}

{{- /* Operator identity: on with the API server (coordinator.kube) unless operatorIdentity.enabled is false. */}}
{{- define "mtc.operatorIdentity" -}}
{{- if and .Values.coordinator.kube .Values.operatorIdentity.enabled }}true{{- end }}
{{- end }}

{{- define "mtc.tlsSecret" -}}
{{ .Values.tls.existingSecret | default "mtc-tls" }}
{{- end }}

{{- /* Peer TLS with the chart's own CA and one certificate for every agent (mtc-peer-tls): neither
the operator's Secret nor a volume of theirs is given. */}}
{{- define "mtc.peerTLSGenerated" -}}
{{- if and .Values.peerTLS.enabled (not .Values.peerTLS.existingSecret) (not .Values.peerTLS.volume) }}true{{- end }}
{{- end }}

{{- define "mtc.peerTLSSecret" -}}
{{ .Values.peerTLS.existingSecret | default "mtc-peer-tls" }}
{{- end }}

{{- /* The one name the generated peer certificate holds: no pod's address is known when it is made. */}}
{{- define "mtc.peerTLSName" -}}
mtc-node
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

{{- /*
The agent's --root on the host, where it mounts the ramdisks with Bidirectional propagation, which the
kubelet allows only on a shared mount. An explicit dataDir wins. Else the installed DaemonSet's
data-root keeps its path, so an upgrade never strands the ramdisks already mounted there. Else a
directory under the kubelet's root, which the kubelet makes rshared itself (a host's `/` may be private).
*/}}
{{- define "mtc.dataDir" -}}
{{- if .Values.dataDir }}
{{- .Values.dataDir }}
{{- else }}
{{- $path := printf "%s/data" (include "mtc.pluginDir" .) }}
{{- $installed := lookup "apps/v1" "DaemonSet" .Release.Namespace "mtc-node" }}
{{- range (dig "spec" "template" "spec" "volumes" (list) $installed) }}
{{- if eq (get . "name") "data-root" }}{{ $path = dig "hostPath" "path" $path . }}{{ end }}
{{- end }}
{{- $path }}
{{- end }}
{{- end }}

{{- /* Where a pod may run: priority, nodeSelector, affinity, tolerations of one component's values. */}}
{{- define "mtc.podScheduling" -}}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "mtc.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- /* Args of (list FLAG VALUE FLAG VALUE ...): each flag whose value is not null, as two items. */}}
{{- define "mtc.flags" -}}
{{- $args := list }}
{{- range $i, $flag := . }}
{{- if and (eq (mod $i 2) 0) (not (kindIs "invalid" (index $ (add1 $i)))) }}
{{- $args = append (append $args $flag) (index $ (add1 $i) | toString) }}
{{- end }}
{{- end }}
{{- with $args }}{{ toYaml . }}{{ end }}
{{- end }}

{{- define "mtc.logFlags" -}}
- --log-level
- {{ .Values.logging.level }}
- --log-format
- {{ .Values.logging.format }}
{{- end }}
