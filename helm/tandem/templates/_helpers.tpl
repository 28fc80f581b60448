{{/* Names, labels, the image and the secrets every Tandem workload shares. */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The name of one component's objects: <fullname>-<component> ("router", "prefill", ...). */}}
{{- define "tandem.componentName" -}}
{{- printf "%s-%s" (include "tandem.fullname" .root) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: tandem
{{ include "tandem.selectorLabels" . }}
{{- end -}}

{{/* Labels of every Tandem object, without a component (monitors select by these). */}}
{{- define "tandem.instanceLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tandem.image" -}}
{{- $tag := default (printf "%s-%s" .Chart.AppVersion .Values.device) .Values.image.tag -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* The in-cluster DNS name of a component's Service. */}}
{{- define "tandem.serviceHost" -}}
{{- printf "%s.%s.svc.%s" (include "tandem.componentName" .) .root.Release.Namespace .root.Values.clusterDomain -}}
{{- end -}}

{{- define "tandem.clusterSecretName" -}}
{{- $s := .Values.auth.clusterSecret -}}
{{- if $s.existingSecret -}}{{ $s.existingSecret }}{{- else if $s.create -}}{{ include "tandem.componentName" (dict "root" . "component" "cluster-secret") }}{{- end -}}
{{- end -}}

{{/* TANDEM_CLUSTER_SECRET from its Secret (nothing when there is none). */}}
{{- define "tandem.clusterSecretEnv" -}}
{{- $name := include "tandem.clusterSecretName" . -}}
{{- if $name }}
- name: TANDEM_CLUSTER_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ $name }}
      key: {{ .Values.auth.clusterSecret.key }}
{{- end }}
{{- end -}}

{{/* terminationGracePeriodSeconds: the preStop sleep, the drain bound (--drain-timeout-s), and 15 s for
the ended requests' answers and the process exit (common/wire/drain.py). */}}
{{- define "tandem.terminationGrace" -}}
{{- add .Values.drain.preStopSleepSeconds .Values.drain.timeoutSeconds 15 -}}
{{- end -}}

{{/* An engine pod's: its preStop hook drains at once (no sleep), then the drain bound and 15 s. */}}
{{- define "tandem.engine.terminationGrace" -}}
{{- add .Values.drain.timeoutSeconds 15 -}}
{{- end -}}

{{/* An engine pod's preStop: SIGTERM to the server at once, then wait for it to exit. Draining, it refuses new
requests (the router retries them on another pair), a decode hands its streams back to the router, which moves
them to another decode going on from the tokens shown (--migration-limit), and a prefill finishes the transfers
it has; so a decode exits within seconds whatever its streams' length (docs/migration.md). The kubelet's own
SIGTERM then finds nothing left to stop. */}}
{{- define "tandem.engine.preStop" -}}
lifecycle:
  preStop:
    exec:
      command: ["sh", "-c", "kill -TERM 1; while kill -0 1 2>/dev/null; do sleep 0.5; done"]
{{- end -}}

{{- define "tandem.preStop" -}}
lifecycle:
  preStop:
    exec:
      command: ["sleep", "{{ .Values.drain.preStopSleepSeconds }}"]
{{- end -}}

{{/* A role's size for people: "2", or "2-4 (autoscaled)". */}}
{{- define "tandem.replicasText" -}}
{{- if .autoscaling.enabled }}{{ .autoscaling.minReplicas }}-{{ .autoscaling.maxReplicas }} (autoscaled){{ else }}{{ .replicas }}{{ end -}}
{{- end -}}

{{/* TANDEM_API_KEY from auth.apiKey's Secret, on the router and every engine pod (the router sends it to
the engines; nothing when there is no key). */}}
{{- define "tandem.apiKeyEnv" -}}
{{- with .Values.auth.apiKey.existingSecret }}
- name: TANDEM_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.auth.apiKey.key }}
{{- end }}
{{- end -}}

{{- define "tandem.scheme" -}}
{{- ternary "https" "http" .Values.tls.enabled -}}
{{- end -}}

{{/* The TLS flags of a server (its certificate, and the CA that verifies its peers): the same names on
`tandem serve`, `tandem bootstrap` (certificate only) and `tandem router`. */}}
{{- define "tandem.tls.args" -}}
{{- $t := .root.Values.tls -}}
{{- if $t.enabled }}
- --ssl-certfile
- {{ printf "%s/%s" $t.mountPath $t.certKey }}
- --ssl-keyfile
- {{ printf "%s/%s" $t.mountPath $t.keyKey }}
{{- if and $t.caKey (not .certOnly) }}
- --ssl-ca-certs
- {{ printf "%s/%s" $t.mountPath $t.caKey }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "tandem.tls.volumes" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
{{- end }}
{{- end -}}

{{- define "tandem.tls.mounts" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}
