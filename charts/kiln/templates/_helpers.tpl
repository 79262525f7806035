{{/* Labels every object gets (the selectors use app.kubernetes.io/name only: engine pods'
NetworkPolicy admits the operator by that label). */}}
{{- define "kiln.labels" -}}
app.kubernetes.io/name: kiln-operator
app.kubernetes.io/instance: {{ .Release.Name | quote }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{- define "kiln.subject" -}}
subjects:
  - kind: ServiceAccount
    name: kiln-operator
    namespace: {{ .Release.Namespace | quote }}
{{- end }}
